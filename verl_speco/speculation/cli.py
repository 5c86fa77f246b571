"""`verl-speco-speculation`: calibrate the cost model on this machine, or re-plan from a calibration.

    verl-speco-speculation calibrate --target DIR --draft EXPORT --prompts chats.jsonl --out runs/speculation
    verl-speco-speculation plan --calibration runs/speculation/calibration.json [--acceptance 0.8,0.6,0.4]

`calibrate` times vLLM's decode step on this machine (the target alone, and with the draft at every
k = 0..--k-max) at each of --batch-sizes, measures the draft's acceptance per position, and writes
`calibration.json`, `plan.json` (the schedule and its predictions) and `plan.png`. `plan` re-plans from
a calibration with another acceptance (a newer draft's held-out figures) without timing anything.
The schedule goes to vLLM 0.32 as `speculative_config.num_speculative_tokens_per_batch_size`; an RL run
reads the calibration through `drafter.speculation_calibration`."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path

from verl_speco.speculation.plan import MIN_GAIN, Calibration, SpeculationPlan, plan
from verl_speco.speculation.report import plan_report, plot, predictions


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def _rates(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="verl-speco-speculation", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)
    cal = sub.add_parser("calibrate", help="time the engine here and plan")
    cal.add_argument("--target", required=True, help="target model directory (HF layout)")
    cal.add_argument("--draft", required=True, help="the drafter's export directory")
    cal.add_argument("--prompts", required=True, help="chat prompts (JSONL, the Feature Store's prompt format)")
    cal.add_argument("--k-max", type=int, default=5, help="largest draft length timed (default 5)")
    cal.add_argument("--batch-sizes", type=_ints, default=[1, 2, 4, 8, 16, 32],
                     help="batch sizes timed, comma-separated; the largest is the engine's max_num_seqs")
    cal.add_argument("--steps", type=int, default=12, help="timed decode steps per point (median)")
    cal.add_argument("--out", default="runs/speculation", help="output directory")
    pl = sub.add_parser("plan", help="re-plan from a calibration file")
    pl.add_argument("--calibration", required=True, help="calibration.json written by `calibrate`")
    pl.add_argument("--acceptance", type=_rates, default=None,
                    help="acceptance rate per draft position, comma-separated (default: the calibration's)")
    pl.add_argument("--out", default=None, help="where plan.json and plan.png go (default: beside the calibration)")
    for sp in (cal, pl):
        sp.add_argument("--min-gain", type=float, default=MIN_GAIN,
                        help=f"gain a k > 0 needs over not drafting (default {MIN_GAIN})")
    return p


def _write(out: Path, calibration: Calibration, speculation: SpeculationPlan) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "plan.json.tmp"
    tmp.write_text(json.dumps(plan_report(calibration, speculation), indent=1) + "\n")
    tmp.replace(out / "plan.json")
    plot(out / "plan.png", predictions(calibration, speculation))
    sizes = list(calibration.step_times.batch_sizes)
    table = predictions(calibration, speculation, sizes)
    print("predicted tokens/s   " + " ".join(f"{'b=' + str(b):>8}" for b in sizes))
    for arm, row in table.items():
        print(f"{arm:<20} " + " ".join(f"{row[b]:>8.1f}" for b in sizes))
    verdict = speculation.describe() if speculation.speculate else "plain decoding (no k pays at any batch size)"
    print(f"schedule: {verdict}")
    print(f"written: {out / 'plan.json'}, {out / 'plan.png'}")


def main(argv: Sequence[str] | None = None) -> int:
    args = parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    if args.command == "plan":
        calibration = Calibration.read(args.calibration)
        if args.acceptance is not None:
            calibration = calibration.with_acceptance(args.acceptance)
        _write(Path(args.out) if args.out else Path(args.calibration).parent, calibration,
               plan(calibration, args.min_gain))
        return 0
    from drafters.common.target import TargetHead
    from verl_speco.evaluation import EvalPrompts, engine_format_of
    from verl_speco.speculation.calibrate import calibrate

    prompts = EvalPrompts.from_jsonl(args.target, args.prompts, limit=max(args.batch_sizes))
    spec = engine_format_of(args.draft, TargetHead.from_pretrained(args.target)).vllm_speculative_config(
        args.draft, args.k_max)
    calibration = calibrate(args.target, args.draft, spec, prompts.token_ids, args.k_max, args.batch_sizes,
                            steps=args.steps)
    out = Path(args.out)
    calibration.write(out / "calibration.json")
    _write(out, calibration, plan(calibration, args.min_gain))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
