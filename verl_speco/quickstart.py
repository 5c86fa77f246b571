"""The README's main job: build target -> collect -> train -> export -> serve in vLLM -> compare.

    verl-speco-quickstart [--algorithm eagle3] [--out runs/quickstart] [--train-prompts N] [--steps N] ...

1. the embedded tiny Qwen3 target (built once, cached: `verl_speco.target`);
2. a Feature Store of the target's own greedy answers to generated prompts (`verl_speco.capture`),
   plus a held-out store for evaluation;
3. a drafter of family `--algorithm` (default eagle3) trained by the standalone trainer
   (`verl_speco.train`, preset `quickstart_<algorithm>`), exported in vLLM's native format at the end;
4. real vLLM (CPU) serving the target with and without the drafter on held-out prompts: greedy
   outputs must be identical (lossless), and vLLM's own spec-decode counters give the acceptance;
5. our reference speculative decoder on the same prompts, for the same figures side by side.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from verl_speco.evaluation import EvalPrompts, export_untrained_like, reference_acceptance, vllm_acceptance


def quickstart_families() -> list[str]:
    """Implemented families that ship a `quickstart_<name>` preset."""
    from drafters.registry import available_families
    from verl_speco.train.compose import default_config_dir

    return [name for name in available_families() if (default_config_dir() / "preset" / f"quickstart_{name}.yaml").is_file()]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="verl-speco-quickstart", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--algorithm", default="eagle3", choices=quickstart_families(),
                   help="drafter family, with its preset configs/preset/quickstart_<algorithm>.yaml "
                        "(default: %(default)s)")
    p.add_argument("--out", default="runs/quickstart", help="working directory (default: %(default)s)")
    p.add_argument("--train-prompts", type=int, default=512, help="prompts answered by the target for training")
    p.add_argument("--eval-prompts", type=int, default=32, help="held-out prompts (store + serving)")
    p.add_argument("--serve-prompts", type=int, default=16, help="held-out prompts served by vLLM")
    p.add_argument("--max-new-tokens", type=int, default=96, help="response length cap for collection/serving")
    p.add_argument("--steps", type=int, default=None, help="training steps (default: the preset's)")
    p.add_argument("--num-speculative-tokens", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--collect-batch-size", type=int, default=128, help="prompts per generation batch")
    p.add_argument("--skip-vllm", action="store_true", help="stop after training and the reference decoder")
    p.add_argument("--json", action="store_true", help="print the final report as JSON")
    return p


def _stage(name: str, t0: float) -> float:
    now = time.perf_counter()
    print(f"[quickstart] {name}: {now - t0:.1f}s", flush=True)
    return now


def run(args: argparse.Namespace) -> dict[str, Any]:
    from verl_speco.capture.collect import collect_features
    from verl_speco.target.build import ensure_target
    from verl_speco.target.datasets import write_prompt_dataset
    from verl_speco.train.compose import load_config
    from verl_speco.train.loop import run as train_run

    out = Path(args.out).resolve()
    (out / "data").mkdir(parents=True, exist_ok=True)
    t_start = t = time.perf_counter()
    target = ensure_target(log=print)
    t = _stage(f"target ready at {target}", t)

    train_jsonl = write_prompt_dataset(out / "data" / "train.jsonl", args.train_prompts, split="train", seed=args.seed)
    eval_jsonl = write_prompt_dataset(out / "data" / "eval.jsonl", args.eval_prompts, split="test", seed=args.seed)
    stores = {}
    for name, data in (("train", train_jsonl), ("eval", eval_jsonl)):
        store = out / "stores" / target.name / args.algorithm / name  # features of one target build and layout
        done = store.parent / f"{name}.collected.json"  # written once the whole store is collected
        if not done.exists():
            shutil.rmtree(store, ignore_errors=True)
            summary = collect_features(target, data, store, algorithm=args.algorithm, generate=True,
                                       max_new_tokens=args.max_new_tokens, seed=args.seed,
                                       batch_size=args.collect_batch_size)
            print(f"[quickstart] collected {name}: {summary}", flush=True)
            done.write_text(json.dumps(dataclasses.asdict(summary)))
        stores[name] = store
    t = _stage("features collected", t)

    overrides = [f"preset=quickstart_{args.algorithm}", f"target.path={target}", f"data.store={stores['train']}",
                 f"data.eval_store={stores['eval']}", f"run.out_dir={out / 'train'}", "run.overwrite=true",
                 f"run.seed={args.seed}"]
    if args.steps is not None:
        overrides.append(f"run.total_steps={args.steps}")
    train_summary = train_run(load_config(overrides))
    export_dir = Path(train_summary["checkpoint"]) / "export"
    t = _stage(f"drafter trained, exported to {export_dir}", t)

    prompts = EvalPrompts.from_jsonl(target, eval_jsonl, limit=args.serve_prompts)
    report: dict[str, Any] = {"algorithm": args.algorithm, "target": str(target), "export": str(export_dir),
                              "num_speculative_tokens": args.num_speculative_tokens,
                              "train": train_summary}
    report["reference"] = reference_acceptance(target, export_dir, prompts, args.num_speculative_tokens,
                                               args.max_new_tokens)
    reference_outputs = report["reference"].pop("outputs")
    t = _stage("reference decoder evaluated", t)
    from verl_speco.engines.vllm_engine import CPU_UNSERVABLE

    if not args.skip_vllm and args.algorithm in CPU_UNSERVABLE:
        print(f"[quickstart] vLLM skipped: {CPU_UNSERVABLE[args.algorithm]}", flush=True)
        report["vllm_skipped"] = CPU_UNSERVABLE[args.algorithm]
    elif not args.skip_vllm:
        untrained = export_untrained_like(export_dir, target, out / "untrained_export", seed=args.seed)
        report["vllm"] = vllm_acceptance(target, {"trained": export_dir, "untrained": untrained}, prompts,
                                         args.num_speculative_tokens, args.max_new_tokens, reference_outputs)
        t = _stage("vLLM evaluated", t)
    report["total_seconds"] = round(time.perf_counter() - t_start, 1)
    return report


def _at(values: list[float], i: int) -> float:
    return values[i] if i < len(values) else 0.0


def _print_report(report: dict[str, Any]) -> None:
    ref, vl = report["reference"], report.get("vllm", {})
    k = report["num_speculative_tokens"]
    cols = [("vLLM trained", vl.get("trained")), ("reference", ref), ("vLLM untrained", vl.get("untrained"))]
    print(f"\n{report['algorithm']} drafter on the embedded target, k={k}, temperature 0")
    print(f"{'':28s}" + "".join(f"{name:>16s}" for name, _ in cols))

    def row(label: str, get: Any) -> None:
        cells = ["-" if c is None else get(c) for _, c in cols]
        print(f"{label:28s}" + "".join(f"{c:>16s}" for c in cells))

    row("mean acceptance length", lambda c: f"{c['mean_acceptance_length']:.3f}")
    row("draft acceptance rate", lambda c: f"{c['draft_acceptance_rate']:.3f}")
    row("drafts", lambda c: str(c["num_drafts"]))
    row("accepted tokens", lambda c: str(c["num_accepted_tokens"]))
    for i in range(k):
        row(f"acceptance at position {i + 1}", lambda c, i=i: f"{_at(c['per_position_acceptance_rate'], i):.3f}")
    for name, c in vl.items():
        print(f"vLLM {name}: greedy outputs identical with/without speculative decoding: {c['lossless']}; "
              f"identical to the reference decoder: {c['matches_reference_outputs']}")
    print(f"total: {report['total_seconds']}s")


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    report = run(args)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print_report(report)
    out = Path(args.out) / "report.json"
    out.write_text(json.dumps(report, indent=2))
    ok = all(c["lossless"] for c in report.get("vllm", {}).values())
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
