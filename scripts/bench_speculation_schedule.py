"""Does the batch-size schedule pay? Calibrate the cost model, plan, then measure side by side in one run.

    python scripts/bench_speculation_schedule.py --target smollm2-135m --draft runs/qs_smollm2/train/export \\
        --out docs/results/speculation

1. held-out prompts of the target (ShareGPT's held-out split for a real target), three disjoint slices:
   calibration, the batch-size grid, the rollout-shaped workload;
2. `verl_speco.speculation.calibrate` on the first slice (or --calibration FILE), then the plan;
3. one vLLM engine per arm (plain, each --fixed-k, the schedule), each decoding: `b` requests of
   --max-new-tokens at every batch size b of --batch-sizes, and the rollout workload (requests with the
   long-tail lengths of a GRPO step, `cost_model.long_tail_lengths`), --repeats times, greedy;
4. per point: measured and predicted (`cost_model.simulate`) tokens/s, the prediction's error, the
   noise (spread of the repeats), lossless (outputs equal plain decoding's).
Writes <out>/bench.json, <out>/table.md, <out>/speculation.png; engine logs to <out>/bench.log.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from verl_speco.speculation.cost_model import fixed_k, k_of_schedule, long_tail_lengths, simulate  # noqa: E402
from verl_speco.speculation.measure import noise, run_arm  # noqa: E402
from verl_speco.speculation.plan import Calibration, plan  # noqa: E402
from verl_speco.speculation.report import plan_report, plot  # noqa: E402


def _args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="smollm2-135m", help="named target or HF directory")
    p.add_argument("--draft", required=True, help="the drafter's export directory, or 'ngram' for vLLM's n-gram proposer")
    p.add_argument("--heldout", default=None, help="held-out chat prompts JSONL (default: the target's)")
    p.add_argument("--calibration", default=None, help="reuse this calibration.json instead of calibrating")
    p.add_argument("--k-max", type=int, default=5)
    p.add_argument("--fixed-k", default="1,3,5")
    p.add_argument("--batch-sizes", default="1,2,4,8,16,32")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--rollout", default="8,4,48,0.9,384",
                   help="prompts, rollouts per prompt, median length, log-space sigma, cap (default 8,4,48,0.9,384)")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="runs/bench_speculation")
    p.add_argument("--replot", action="store_true", help="only draw the chart and table again from <out>/bench.json")
    return p.parse_args(argv)


def _prompts(args: argparse.Namespace, out: Path, target: Path, need: int) -> list[list[int]]:
    from verl_speco.evaluation import EvalPrompts
    from verl_speco.target.named import write_target_prompts

    heldout = Path(args.heldout) if args.heldout else write_target_prompts(args.target, out / "data", 0, need)["eval"]
    ids = EvalPrompts.from_jsonl(target, heldout, limit=need).token_ids
    if len(ids) < need:
        raise SystemExit(f"--heldout: {heldout} has {len(ids)} prompts, the run needs {need}")
    return ids


def main(argv: list[str] | None = None) -> int:
    args = _args(argv)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from drafters.common.target import TargetHead
    from verl_speco.console import Console
    from verl_speco.engines.vllm_engine import NGRAM_SPEC, context_length
    from verl_speco.evaluation import engine_format_of
    from verl_speco.speculation.calibrate import calibrate
    from verl_speco.target.named import resolve_target

    out = Path(args.out)
    if args.replot:
        _draw(out, json.loads((out / "bench.json").read_text()))
        return 0
    out.mkdir(parents=True, exist_ok=True)
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    fixed = [int(k) for k in args.fixed_k.split(",")]
    n_prompts, per_prompt, median, sigma, cap = args.rollout.split(",")
    lengths = long_tail_lengths(int(n_prompts) * int(per_prompt), float(median), float(sigma), int(cap))
    lengths = [lengths[(7 * i) % len(lengths)] for i in range(len(lengths))]  # spread over the prompts
    max_b = max(sizes)
    with Console(out / "bench.log", append=True) as console:
        target = Path(resolve_target(args.target))
        prompts = _prompts(args, out, target, 2 * max_b + int(n_prompts))
        cal_prompts, grid_prompts, roll_prompts = prompts[:max_b], prompts[max_b:2 * max_b], prompts[2 * max_b:]
        draft = None if args.draft == "ngram" else Path(args.draft)

        fmt = None if draft is None else engine_format_of(draft, TargetHead.from_pretrained(target))

        def spec_of(k: int) -> dict[str, Any]:
            if draft is None or fmt is None:
                return {**NGRAM_SPEC, "num_speculative_tokens": k}
            return dict(fmt.vllm_speculative_config(draft, k))
        if args.calibration:
            calibration = Calibration.read(args.calibration)
        else:
            with console.stage("calibrate", total=(args.k_max + 2) * len(sizes) * 2) as bar:
                calibration = calibrate(target, draft, spec_of(args.k_max),
                                        cal_prompts, args.k_max, sizes, tick=bar.update)
            calibration.write(out / "calibration.json")
        speculation = plan(calibration)  # the per-batch ranges; "auto" decides per workload (_compare)
        workloads: dict[str, list[tuple[list[int], int]]] = {
            f"b={b}": [(grid_prompts[i], args.max_new_tokens) for i in range(b)] for b in sizes}
        workloads["rollout"] = [(roll_prompts[i // int(per_prompt)], n) for i, n in enumerate(lengths)]
        longest = max(len(p) for p in prompts)
        max_len = context_length(longest, max(args.max_new_tokens, max(lengths)), args.k_max)
        arms: dict[str, dict[str, Any] | None] = {"plain": None}
        arms.update({f"k={k}": spec_of(k) for k in fixed})
        if any(k for _, _, k in speculation.schedule):  # the drafting engine under the per-batch ranges
            arms["schedule"] = {**spec_of(speculation.k_max), **speculation.vllm_fields()}
        measured: dict[str, dict[str, Any]] = {}
        with console.stage("measure", total=len(arms) * len(workloads) * args.repeats) as bar:
            for arm, spec in arms.items():
                measured[arm] = run_arm(target, spec, workloads, args.repeats, max_b, max_len,
                                        tick=bar.update)
    report = _compare(calibration, speculation, measured, workloads, fixed)
    report["plan"] = plan_report(calibration, speculation)
    report["settings"] = {k: v for k, v in vars(args).items()}
    (out / "bench.json").write_text(json.dumps(report, indent=1) + "\n")
    _draw(out, report)
    return 0


def _draw(out: Path, report: dict[str, Any]) -> None:
    """table.md and speculation.png from a report (the run's, or bench.json's with --replot)."""
    (out / "table.md").write_text(_table(report) + "\n")

    def grid(key: str) -> dict[str, dict[int, float]]:
        return {arm: {int(w[2:]): row[w][key] for w in row if w.startswith("b=")}
                for arm, row in report["points"].items() if arm != "auto"}  # auto is one of the others per point

    settings, described = report["settings"], report["plan"]["describe"] if report["plan"]["speculate"] else "plain"
    plot(out / "speculation.png", grid("predicted_tokens_per_s"), grid("measured_tokens_per_s"),
         title=f"{settings['target']}: b requests of {settings['max_new_tokens']} tokens; schedule {described}")
    print(_table(report))
    print(f"written: {out / 'bench.json'}, {out / 'table.md'}, {out / 'speculation.png'}")


def _compare(calibration: Calibration, speculation: Any, measured: dict[str, dict[str, Any]],
             workloads: dict[str, list[tuple[list[int], int]]], fixed: list[int]) -> dict[str, Any]:
    """Per arm and workload: measured (fastest repeat) and predicted tokens/s, the error, the spread, lossless.
    "auto" is what the planner picks for that workload (`plan(..., workload=its lengths)`): the drafting
    schedule where it predicts a gain, else plain decoding; the verdict sets it against the best of plain
    and the fixed k, and says whether a shortfall is beyond the two points' run-to-run spread."""
    times, rates = calibration.step_times, calibration.per_position
    k_of: dict[str, Any] = {"plain": fixed_k(None), **{f"k={k}": fixed_k(k) for k in fixed},
                            "schedule": k_of_schedule(speculation.schedule)}
    points: dict[str, dict[str, Any]] = {}
    for arm, runs in measured.items():
        for name, run in runs.items():
            lengths = [n for _, n in workloads[name]]
            predicted_s = simulate(times, rates, lengths, k_of[arm], calibration.max_num_seqs)
            wall = min(run["wall_s"])  # the least disturbed repeat (measure.noise)
            points.setdefault(arm, {})[name] = {
                "wall_s": run["wall_s"], "tokens": run["tokens"], "measured_tokens_per_s": run["tokens"] / wall,
                "predicted_tokens_per_s": run["tokens"] / predicted_s, "prediction_error": predicted_s / wall - 1,
                "noise": noise(run["wall_s"]), "lossless": run["outputs"] == measured["plain"][name]["outputs"]}
    verdict: dict[str, Any] = {}
    for name, work in workloads.items():
        chosen = "schedule" if "schedule" in points and plan(calibration, workload=[n for _, n in work]).speculate \
            else "plain"
        points.setdefault("auto", {})[name] = {**points[chosen][name], "chosen": chosen}
        best = max(("plain", *(f"k={k}" for k in fixed)), key=lambda a: points[a][name]["measured_tokens_per_s"])
        auto, top = points["auto"][name], points[best][name]
        ratio = auto["measured_tokens_per_s"] / top["measured_tokens_per_s"]
        verdict[name] = {"auto": chosen, "best_other": best, "auto_vs_best": ratio,
                         "auto_vs_plain": auto["measured_tokens_per_s"] / points["plain"][name]["measured_tokens_per_s"],
                         "slower_beyond_noise": ratio < 1 - max(auto["noise"], top["noise"])}
    spreads = sorted(p["noise"] for arm, row in points.items() if arm != "auto" for p in row.values())
    return {"points": points, "verdict": verdict, "median_noise": spreads[len(spreads) // 2], "max_noise": spreads[-1],
            "max_abs_prediction_error": max(abs(p["prediction_error"]) for row in points.values() for p in row.values()),
            "all_lossless": all(p["lossless"] for row in points.values() for p in row.values())}


def _table(report: dict[str, Any]) -> str:
    points, verdict = report["points"], report["verdict"]
    names = list(next(iter(points.values())))
    arms = [a for a in points if a != "auto"]
    head = "| workload | " + " | ".join(f"{a} tok/s (pred)" for a in arms) + " | auto picks | auto / best other | " \
        "auto / plain |"
    lines = [head, "|" + "---|" * (len(arms) + 4)]
    for name in names:
        cells = [f"{points[a][name]['measured_tokens_per_s']:.1f} ({points[a][name]['predicted_tokens_per_s']:.1f})"
                 for a in arms]
        v = verdict[name]
        flag = " (beyond noise)" if v["slower_beyond_noise"] else ""
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {v['auto']} | {v['auto_vs_best']:.3f} "
                     f"({v['best_other']}){flag} | {v['auto_vs_plain']:.3f} |")
    lines.append(f"\nrepeat spread (max - min) / min: median {report['median_noise']:.1%}, largest "
                 f"{report['max_noise']:.1%}; largest prediction error {report['max_abs_prediction_error']:.1%}; "
                 f"every arm lossless: {report['all_lossless']}; schedule: {report.get('plan', {}).get('describe', '')}")
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
