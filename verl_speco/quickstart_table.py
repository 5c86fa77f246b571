"""The quickstart's table and chart: `summarize(report)` (printed and written to summary.json),
`table_lines(summary)` and `plot_positions(summary, path)`, one column per run that took place."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from verl_speco.evaluation import NGRAM

COLUMNS = ("vLLM trained", "reference", "vLLM untrained", "vLLM n-gram")  # the table's columns, left to right


def _at(values: list[float], i: int) -> float:
    return values[i] if i < len(values) else 0.0


def summarize(report: dict[str, Any]) -> dict[str, Any]:
    """The table's figures (what `table_lines` prints and `summary.json` holds): per row, one value
    per column (those of `COLUMNS` that ran), rates rounded as printed."""
    ref, vl = report["reference"], report.get("vllm", {})
    k = report["num_speculative_tokens"]
    runs = {name: c for name, c in zip(COLUMNS, (vl.get("trained"), ref, vl.get("untrained"), vl.get(NGRAM)))
            if c is not None}

    def row(get: Any) -> list[Any]:
        return [get(c) for c in runs.values()]

    rows: dict[str, list[Any]] = {
        "tokens per target forward": row(lambda c: round(float(c["tokens_per_target_forward"]), 3)),
        "mean acceptance length": row(lambda c: round(float(c["mean_acceptance_length"]), 3)),
        "draft acceptance rate": row(lambda c: round(float(c["draft_acceptance_rate"]), 3)),
        "drafts": row(lambda c: int(c["num_drafts"])),
        "accepted tokens": row(lambda c: int(c["num_accepted_tokens"])),
    }
    for i in range(k):
        rows[f"acceptance at position {i + 1}"] = row(
            lambda c, i=i: round(float(_at(c["per_position_acceptance_rate"], i)), 3))
    return {"family": report["family"], "target": report.get("target_name", "embedded"),
            "num_speculative_tokens": k, "temperature": 0.0, "columns": list(runs), "rows": rows,
            "vllm_checks": {f"vLLM {'n-gram' if name == NGRAM else name}": {
                "lossless": c["lossless"], "matches_reference_outputs": c["matches_reference_outputs"]}
                for name, c in vl.items()},
            **({"trained_over_ngram": round(vl["trained"]["tokens_per_target_forward"]
                                            / vl[NGRAM]["tokens_per_target_forward"], 3)}
               if "trained" in vl and NGRAM in vl else {}),
            **({"vllm_skipped": report["vllm_skipped"]} if "vllm_skipped" in report else {}),
            **({"results": report["results"]} if report.get("results") else {}),
            **({"speculation": _speculation(report["speculation"])} if "speculation" in report else {}),
            "total_seconds": report["total_seconds"]}


def _speculation(trial: dict[str, Any]) -> dict[str, Any]:
    """The schedule trial's figures (verl_speco.speculation.trial): the plan, and the rollout-shaped batch's
    seconds measured and predicted, plain against the plan."""
    measured, predicted = trial["measured_s"], trial["predicted_s"]
    return {"schedule": trial["describe"] if trial["speculate"] else "plain decoding (no k pays here)",
            "requests": len(trial["lengths"]), "tokens": sum(trial["lengths"]),
            "plain_s": round(measured["plain"], 2), "schedule_s": round(measured["schedule"], 2),
            "speedup": round(measured["plain"] / measured["schedule"], 3),
            "predicted_speedup": round(predicted["plain"] / predicted["schedule"], 3), "lossless": trial["lossless"]}


def _cell(value: Any) -> str:
    return f"{value:.3f}" if isinstance(value, float) else str(value)


def table_lines(summary: dict[str, Any]) -> list[str]:
    lines = [f"{summary['family']} drafter on the {summary['target']} target, k={summary['num_speculative_tokens']}, "
             "temperature 0",
             f"{'':28s}" + "".join(f"{name:>16s}" for name in summary["columns"])]
    lines += [f"{label:28s}" + "".join(f"{_cell(v):>16s}" for v in values) for label, values in summary["rows"].items()]
    for name, c in summary["vllm_checks"].items():
        lines.append(f"{name}: greedy outputs identical with/without speculative decoding: {c['lossless']}; "
                     f"identical to the reference decoder: {c['matches_reference_outputs']}")
    if "vllm_skipped" in summary:
        lines.append(f"vLLM skipped: {summary['vllm_skipped']}")
    if "trained_over_ngram" in summary:
        tpf = summary["rows"]["tokens per target forward"]
        lines.append(f"vLLM trained against vLLM n-gram: {tpf[0]:.3f} / {tpf[-1]:.3f} = "
                     f"{summary['trained_over_ngram']:.2f}x generated tokens per target forward")
    if "speculation" in summary:
        sp = summary["speculation"]
        lines.append(f"speculation auto (calibrated here): {sp['schedule']}; {sp['requests']} requests of long-tail "
                     f"lengths ({sp['tokens']} tokens): plain {sp['plain_s']}s, planned {sp['schedule_s']}s "
                     f"({sp['speedup']:.2f}x, predicted {sp['predicted_speedup']:.2f}x), lossless: {sp['lossless']}")
    if "results" in summary:
        lines.append(f"a longer budget: {summary['results']}")
    return lines + [f"total: {summary['total_seconds']}s"]


def plot_positions(summary: dict[str, Any], path: Path) -> Path | None:
    """Grouped bars: the acceptance rate at each draft position, one bar per column of the table
    (None when matplotlib is missing)."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    k = summary["num_speculative_tokens"]
    rows = [summary["rows"][f"acceptance at position {i + 1}"] for i in range(k)]
    series = list(enumerate(summary["columns"]))
    width = 0.8 / max(1, len(series))
    fig, ax = plt.subplots(figsize=(max(5.0, 1.2 * k + 2.5), 3.8))
    for s, (j, name) in enumerate(series):
        xs = [i + 1 + (s - (len(series) - 1) / 2) * width for i in range(k)]
        bars = ax.bar(xs, [r[j] for r in rows], width, label=name)
        ax.bar_label(bars, fmt="%.2f", fontsize=7, padding=1)
    ax.set_xticks(range(1, k + 1))
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate (accepted / drafts)")
    ax.set_ylim(0.0, 1.08)
    ax.set_title(f"{summary['family']} drafter on the {summary['target']} target: acceptance per draft "
                 f"position (k={k}, greedy)", fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
