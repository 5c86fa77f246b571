"""The seven-family comparison's report rendering (`scripts/bench_family_acceptance.py`): the
families as the catalog has them, the drafting cost of a round, the markdown tables and the PNG chart.

Every per-family fact comes from the catalog: the families (`drafters.registry.known_families`), the
setting that fixes the drafts per round (`draft_depth_settings`: block_size, num_depths), the vLLM
method (`engine_method(f, "vllm").label()`) and what vLLM cannot serve on CPU and why
(`verl_speco.engines.vllm_engine.CPU_UNSERVABLE`, in a few words `CPU_UNSERVABLE_SHORT`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from drafters.registry import draft_depth_settings, engine_method, has_engine_method, known_families
from verl_speco.engines.vllm_engine import CPU_UNSERVABLE, CPU_UNSERVABLE_SHORT

FAMILIES = known_families()
VLLM_METHOD = {f: engine_method(f, "vllm").label() for f in FAMILIES if has_engine_method(f, "vllm")}


def vllm_served(families: list[str]) -> list[str]:
    """The families vLLM serves on its CPU platform here: a vLLM method in the catalog, not CPU_UNSERVABLE."""
    return [f for f in families if f in VLLM_METHOD and f not in CPU_UNSERVABLE]


def drafting_cost(family: str, k: int, tree: dict[str, int] | None) -> dict[str, Any]:
    """Drafted tokens per target forward and the draft forwards of one round (reference decoder).

    chains (eagle1, eagle3): a prefill forward over the new tokens gives draft 1, then k - 1
    single-token steps: k forwards. EAGLE-2 tree (`build_draft_tree`): the root's expansion, then
    one forward per further depth over every expanded node: `depth` forwards, `total_tokens` nodes.
    dflash: one block forward. peagle: one forward over the context rows + k - 1 mask rows. dspark:
    one backbone forward over [x_n, MASK x (k - 1)], then k sequential Markov-head steps (slot j's
    logits = lm_head(h_j) + W2 W1[d_{j-1}], the previous draft's rank-r embedding; no attention, no
    layer). domino: one backbone forward over the full block, then k GRU-cell steps (x_n, d_1, ..,
    d_{k-1}) feeding the embed_proj correction of slots 1..k-1."""
    if tree is not None:
        return {"tokens_per_target_forward": tree["total_tokens"], "draft_forwards": tree["depth"],
                "head_steps": 0, "forwards_text": f"{tree['depth']} (tree depth)"}
    if not draft_depth_settings(family, k):  # a chain: k is a decoding choice
        return {"tokens_per_target_forward": k, "draft_forwards": k, "head_steps": 0, "forwards_text": f"{k}"}
    if family == "dspark":
        return {"tokens_per_target_forward": k, "draft_forwards": 1, "head_steps": k,
                "forwards_text": f"1 backbone + {k} sequential Markov-head steps"}
    if family == "domino":
        return {"tokens_per_target_forward": k, "draft_forwards": 1, "head_steps": k,
                "forwards_text": f"1 backbone + {k} GRU-cell steps"}
    return {"tokens_per_target_forward": k, "draft_forwards": 1, "head_steps": 0, "forwards_text": "1"}


def _fmt_params(n: int | None) -> str:
    return "-" if n is None else f"{n:,}"


def _fmt_ms(cpu: float | None, wall: float | None) -> str:
    if cpu is None:
        return "-"
    return f"{cpu:.0f}" if wall is None else f"{cpu:.0f} ({wall:.0f})"


def table(report: dict[str, Any]) -> str:
    """The README table (markdown), footnotes under it."""
    k = report["k"]
    lines = ["| family | drafting | trainable params | train step, ms: CPU (wall) | drafted tokens / target fwd | "
             "draft forwards / round | tokens trained | ref. greedy | ref. greedy, generated tokens / target fwd | "
             "vLLM greedy (method) | ref. T=1 | ref. T=1, sampled drafts | vLLM T=1 |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for fam, r in report["families"].items():
        tree = r["tree"]
        name = fam.removesuffix(" (tree)")
        cost = r.get("cost") or drafting_cost(name, k, tree)
        if tree:
            drafting = f"tree top_k={tree['top_k']}, depth={tree['depth']}, {tree['total_tokens']} tokens/round"
        elif "block_size" in draft_depth_settings(name, k):
            drafting = f"block {draft_depth_settings(name, k)['block_size']}, k={k}, one draft forward"
        elif "num_depths" in draft_depth_settings(name, k):
            drafting = f"parallel, {k} depths in one forward"
        else:
            drafting = f"chain, k={k}"
        if name == "eagle2":
            drafting += " (eagle1 weights)"
        tokens = f"{cost['tokens_per_target_forward']}"
        measured = r.get("measured_tokens_per_draft")
        if measured is not None and abs(measured - cost["tokens_per_target_forward"]) > 1e-9:
            tokens += f" (mean {measured:.2f} nodes)"
        vl = r.get("vllm_greedy")
        if vl is not None:
            vcell = f"{vl['mean_acceptance_length']:.3f} ({VLLM_METHOD[name]}; lossless {'yes' if vl['lossless'] else 'NO'})"
        elif "vllm_unservable" in r:
            vcell = f"- ({CPU_UNSERVABLE_SHORT.get(name, 'not served on CPU')})"
        elif "vllm_error" in r:
            vcell = f"- (vLLM failed: {r['vllm_error'].split(':')[0]})"
        elif forced_tree_row(fam):
            vcell = "- (no tree in vLLM 0.32)"
        else:
            vcell = "-"
        vt1, sd, t1 = r.get("vllm_t1"), r.get("t1_sampled_drafts"), r.get("t1")
        tpf = r["greedy"].get("tokens_per_target_forward")
        lines.append(f"| {fam} | {drafting} | {_fmt_params(r.get('trainable_params'))} | "
                     f"{_fmt_ms(r.get('step_ms_median'), r.get('timing', {}).get('wall_ms_median'))} | {tokens} | {cost['forwards_text']} | {r['tokens_seen']} | "
                     f"{r['greedy']['mean_acceptance_length']:.3f} | {_fmt_tpf(tpf, r['greedy'])} | "
                     f"{vcell} | {'-' if t1 is None else format(t1['mean_acceptance_length'], '.3f')} | "
                     f"{'-' if sd is None else format(sd['mean_acceptance_length'], '.3f')} | "
                     f"{'-' if vt1 is None else format(vt1['mean_acceptance_length'], '.3f')} |")
    return "\n".join(lines) + "\n\n" + "\n".join(footnotes(report))


def _fmt_tpf(tpf: float | None, greedy: dict[str, Any]) -> str:
    """Generated tokens per target forward, with its 90% bootstrap interval over prompts when the
    decode recorded one: "2.424 (2.31-2.54)"."""
    if tpf is None:
        return "-"
    interval = greedy.get("tokens_per_target_forward_interval90")
    return f"{tpf:.3f}" if interval is None else f"{tpf:.3f} ({interval[0]:.2f}-{interval[1]:.2f})"


def speed_table(report: dict[str, Any]) -> str:
    """vLLM greedy, side by side in one run: plain decoding, the n-gram proposer, each served family."""
    speed = report["vllm_side_by_side"]
    lines = [f"| vLLM method (k = {report['k']}) | generated tokens / target fwd | mean acceptance length | "
             "output tokens/s | vs plain | lossless |", "|---|---|---|---|---|---|"]
    for name, r in speed.items():
        if not isinstance(r, dict):
            continue
        if "error" in r:
            lines.append(f"| {name} | - | - | - | - | vLLM failed: {r['error'].split(':')[0]} |")
            continue
        mal = r.get("mean_acceptance_length")
        mal_text = "-" if name == "plain" or mal is None or mal != mal else f"{mal:.3f}"
        lines.append(f"| {name} | {r['tokens_per_target_forward']:.3f} | {mal_text} | {r['output_tokens_per_s']:.1f} | "
                     f"{r.get('speedup_vs_plain', 1.0):.2f}x | {'yes' if r.get('lossless', True) else 'NO'} |")
    load = speed.get("loadavg_1min")
    return "\n".join(lines) + ("\n\nOne process, engines one after another, the same prompts in one batch "
                               f"(max_num_seqs 16), CPU float32, eager; 1-min load average {load:.1f} on "
                               f"{speed.get('cpu_count')} CPUs at the end." if load is not None else "")


def forced_tree_row(row: str) -> bool:
    return row.endswith(" (tree)")


def footnotes(report: dict[str, Any]) -> list[str]:
    fams = report["families"]
    frozen = sorted({(f.removesuffix(" (tree)"), r["frozen_params"]) for f, r in fams.items()
                     if r.get("frozen_params")})
    timing = report.get("timing", {})
    load = timing.get("loadavg_1min_before_after")
    budget = sorted({r["tokens_seen"] for r in fams.values()})
    notes = [f"Budget: {report['steps']} training steps per family, {', '.join(map(str, budget))} tokens "
             f"(from each run's checkpoint), one union-layout store of {report.get('train_prompts', '?')} prompts; "
             f"{report.get('eval_prompts', '?')} held-out prompts, up to {report.get('max_new_tokens', '?')} new tokens; "
             f"k = {report['k']} drafts per target forward.",
             "Mean acceptance length = 1 + accepted / drafts (vLLM's convention); T=1 with greedy drafts, and "
             "with drafts sampled from the draft's own distribution (rejection sampling, lossless). In parentheses "
             "after generated tokens / target fwd: its 90% bootstrap interval over the held-out prompts, which "
             "says how far other prompts could move it.",
             "Trainable params: requires_grad parameters of the model the trainer builds. Frozen target pieces "
             "are excluded: the frozen embedding copy ("
             + (", ".join(f"{f} {n:,}" for f, n in frozen) if frozen else "none")
             + " parameters) and the target LM head / the block drafters' target embedding (buffers). "
             "EAGLE-3 / P-EAGLE's own draft-vocab head is trained and counted.",
             "Train step: not timed in this run (--time-steps 0); each family's training log has its step times."
             if not timing.get("timed_steps") else
             f"Train step: a dedicated timing pass after all training, on one fixed micro-batch "
             f"({timing.get('batch_sequences', '?')} sequences, the same samples for every family): "
             f"{timing.get('warmup_steps', '?')} warm-up steps per family, then {timing.get('timed_steps', '?')} "
             f"rounds of one step per family (round-robin), of the trainer's `train_step` (collate, forward, "
             f"loss, backward, clip, AdamW; store reading excluded), CPU float32, "
             f"{timing.get('torch_threads', '?')} torch thread(s); the median per family of the step's process "
             f"CPU time (its work, insensitive to other jobs on a shared machine) and, in parentheses, of its "
             f"wall time"
             + (f" (1-min load average {load[0]:.1f} -> {load[1]:.1f} on {timing.get('cpu_count')} CPUs during "
                "the pass: the wall time carries that contention)" if load else "")
             + ". eagle2 and eagle3 (tree) rows reuse eagle1's / eagle3's model.",
             "Draft forwards / round: draft-model forwards run one after another before the one verification "
             "forward (reference decoder); dspark's Markov-head steps (lm_head row + rank-r bias of the previous "
             "draft's embedding) and domino's GRU-cell steps are sequential but run no attention layer."]
    errors = {f: r["vllm_error"] for f, r in fams.items() if "vllm_error" in r}
    for f, e in errors.items():
        notes.append(f"vLLM could not serve {f}: {e}")
    return notes


def chart_series(report: dict[str, Any]) -> list[tuple[str, str]]:
    """(legend label, report key) of the chart's bar series that have a figure for some family: a
    --greedy-only report gets one series, centred on its tick, and no empty legend entries."""
    every = [("greedy", "greedy"), ("T=1, greedy drafts", "t1"), ("T=1, sampled drafts", "t1_sampled_drafts")]
    return [(label, key) for label, key in every if any(key in fam for fam in report["families"].values())]


def plot(report: dict[str, Any], path: Path) -> Path:
    """Bar chart of the reference decoder's mean acceptance length per family: greedy, T=1 (greedy
    drafts), T=1 (sampled drafts, chains and blocks)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = list(report["families"])
    series = chart_series(report)
    width = 0.8 / len(series)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(rows) + 2), 4.2))
    for i, (label, key) in enumerate(series):
        xs = [j + (i - (len(series) - 1) / 2) * width for j, r in enumerate(rows) if key in report["families"][r]]
        ys = [report["families"][r][key]["mean_acceptance_length"] for r in rows if key in report["families"][r]]
        bars = ax.bar(xs, ys, width, label=label)
        ax.bar_label(bars, fmt="%.2f", fontsize=6, padding=1)
    ax.set_xticks(range(len(rows)), rows, rotation=20, ha="right")
    ax.set_ylabel("mean acceptance length (1 + accepted / drafts)")
    ax.set_ylim(1.0, None)
    where = report.get("target_name", "embedded")
    where += f", held-out {report['eval_set']}" if report.get("eval_set", "heldout") != "heldout" else ""
    ax.set_title(f"{where}: k={report['k']}, {report['steps']} steps per family (reference decoder)", fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


