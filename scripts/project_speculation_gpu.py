"""The speculation schedule on paper for a GPU: Qwen3-8B with an EAGLE-3 or DFlash draft on H100 / H200.

    python scripts/project_speculation_gpu.py --acceptance eagle3=docs/results/speculation/calibration.json \\
        --acceptance dflash=0.337,0.133,0.063 --out docs/results/speculation

Step times from `verl_speco.speculation.roofline` (datasheet bandwidth and FLOP/s at assumed achieved
fractions, or --hardware FILE: what `scripts/gpu_check.sh` measured on a lent GPU), acceptance per
position from our measurements (a calibration.json, or rates given inline), the plan the cost model
chooses per batch size, and the predicted wall-clock of a GRPO step's rollout (--rollout: requests,
median length, log-space sigma, cap; long-tail lengths as in `cost_model.long_tail_lengths`) for plain
decoding, each fixed k and the schedule. Writes <out>/gpu_projection.json and .md.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from verl_speco.speculation import roofline  # noqa: E402
from verl_speco.speculation.cost_model import fixed_k, k_of_schedule, long_tail_lengths, simulate  # noqa: E402
from verl_speco.speculation.plan import Calibration, plan  # noqa: E402

DRAFTS = {"eagle3": roofline.EAGLE3_QWEN3_8B, "dflash": roofline.DFLASH_QWEN3_8B}
BATCHES = [1, 2, 4, 8, 16, 32, 64, 128, 256]


def _rates(text: str) -> list[float]:
    path = Path(text)
    if path.suffix == ".json":
        return list(Calibration.read(path).per_position)
    return [float(x) for x in text.split(",")]


def _hardware(text: str) -> roofline.Hardware:
    if text in ("h100", "h200"):
        return roofline.H100 if text == "h100" else roofline.H200
    found = _find_hardware(json.loads(Path(text).read_text()))
    if found is None:
        raise SystemExit(f"--hardware: {text} holds no mapping with name, bytes_per_s and flops (expected the "
                         "device check's JSON, or h100 / h200)")
    return roofline.Hardware(str(found["name"]), float(found["bytes_per_s"]), float(found["flops"]))


def _find_hardware(raw: Any) -> dict[str, Any] | None:
    """The first mapping with bytes_per_s and flops, anywhere in a JSON document (the device check's
    report nests it in its speculation_roofline row)."""
    if isinstance(raw, dict):
        if {"name", "bytes_per_s", "flops"} <= set(raw):
            return raw
        raw = list(raw.values())
    if isinstance(raw, list):
        for item in raw:
            found = _find_hardware(item)
            if found is not None:
                return found
    return None


def project(hw: roofline.Hardware, family: str, rates: list[float], lengths: list[int], prompt: int,
            max_num_seqs: int) -> dict[str, Any]:
    context = prompt + sum(lengths) // (2 * len(lengths))  # the mean context over a response
    times = roofline.paper_step_times(hw, roofline.QWEN3_8B, DRAFTS[family], family, BATCHES, len(rates),
                                      context, prompt)
    speculation = plan(Calibration(times, tuple(rates), max_num_seqs))
    plain_s = simulate(times, rates, lengths, fixed_k(None), max_num_seqs)
    arms = {"plain": plain_s}
    arms.update({f"k={k}": simulate(times, rates, lengths, fixed_k(k), max_num_seqs)
                 for k in range(1, len(rates) + 1)})
    arms["schedule"] = (simulate(times, rates, lengths, k_of_schedule(speculation.schedule), max_num_seqs)
                        if speculation.speculate else plain_s)
    return {"hardware": hw.name, "family": family, "acceptance": rates, "context": context,
            "schedule": speculation.describe() if speculation.speculate else "plain decoding",
            "rollout_s": arms, "speedup_vs_plain": {a: plain_s / s for a, s in arms.items()},
            "plain_step_ms": {b: 1e3 * t for b, t in zip(BATCHES, times.plain_step_s)}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--acceptance", action="append", required=True,
                   help="family=rates (comma-separated, or a calibration.json); eagle3 and dflash")
    p.add_argument("--hardware", action="append", default=None, help="h100, h200 or a measured JSON (repeatable)")
    p.add_argument("--rollout", default="256,1024,0.8,8192", help="requests, median, sigma, cap")
    p.add_argument("--prompt", type=int, default=512, help="prompt tokens")
    p.add_argument("--out", default="runs/speculation_gpu")
    args = p.parse_args(argv)
    n, median, sigma, cap = args.rollout.split(",")
    lengths = long_tail_lengths(int(n), float(median), float(sigma), int(cap))
    rows = []
    for hw in [_hardware(h) for h in (args.hardware or ["h100", "h200"])]:
        for item in args.acceptance:
            family, rates = item.split("=", 1)
            rows.append(project(hw, family, _rates(rates), lengths, args.prompt, int(n)))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_projection.json").write_text(json.dumps({"rollout": args.rollout, "prompt": args.prompt,
                                                          "rows": rows}, indent=1) + "\n")
    lines = ["| hardware | draft | acceptance per position | schedule | rollout speedup vs plain: "
             "best fixed k | schedule |", "|---|---|---|---|---|---|"]
    for r in rows:
        fixed = {a: v for a, v in r["speedup_vs_plain"].items() if a.startswith("k=")}
        best = max(fixed, key=lambda a: fixed[a])
        lines.append(f"| {r['hardware']} | {r['family']} | {', '.join(f'{x:.2f}' for x in r['acceptance'])} | "
                     f"{r['schedule']} | {fixed[best]:.2f}x ({best}) | {r['speedup_vs_plain']['schedule']:.2f}x |")
    (out / "gpu_projection.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
