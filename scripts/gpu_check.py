"""GPU check (run by scripts/gpu_check.sh): one training step of every drafter family on one accelerator,
bf16 with flex attention, FSDP2 over NCCL with one rank, at Qwen3-8B draft shapes (hidden 4096, 32/8
heads, intermediate 12288, vocab 151936, draft vocab 32000; DFlash/DSpark/Domino 5 layers and 512
anchors, P-EAGLE 4 layers and 8 depths, EAGLE-3 7 TTT steps; one sequence of 2048 tokens), then the
named checks of benchmarks/device_checks.py.

Each family and each check is a unit with a timeout of its own (--family-timeout-s, --check-timeout-s,
counted once the worker is ready: --startup-timeout-s), run in a worker process
(benchmarks/device_check_runner.py: a unit past its timeout is killed and recorded as "timeout", the
units after it still run; the whole run stops at --budget-s). Every unit's row is printed and written
to --json the moment it finishes. A family's row: step time, peak memory,
model FLOP utilisation, its masks checked on the device (benchmarks/device_check_family.py); eagle2
is EAGLE-1's weights and objective (its tree is a decoding choice): its row is eagle1's step.
`--device cpu --tiny` runs the same path on CPU with tiny shapes and SDPA (the CI smoke run).
Exit status 0 when every unit passed within --budget-s, else 1; 2 on a bad flag.
It imports only torch, numpy and safetensors besides this repository (no omegaconf, tqdm, vLLM, Ray).
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.device_check_runner import Report, Unit, supervise  # noqa: E402
from benchmarks.device_checks import ALL_CHECKS, CHECKS  # noqa: E402
from drafters.registry import catalog_entry, known_families, training_families  # noqa: E402

FAMILIES = training_families()  # the catalog's families with their own training step (eagle2 trains as eagle1)
CHECK_NAMES = tuple(c.name for c in ALL_CHECKS)
TINY = dict(hidden=128, heads=4, kv_heads=2, intermediate=256, vocab=2048, draft_vocab=512, seq_len=128,
            layers=1, peagle_layers=2, num_anchors=8, context_layers=3, markov_rank=32, gru_hidden=64, emb_dim=64)


def _subset(p: argparse.ArgumentParser, flag: str, value: str, valid: tuple[str, ...]) -> list[str]:
    names = [n for n in value.split(",") if n]
    bad = [n for n in names if n not in valid]
    if bad:
        p.error(f"--{flag}: got {bad}, expected a subset of {','.join(valid)}")
    return names


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--tiny", action="store_true", help=f"tiny shapes (CPU smoke run): {TINY}")
    p.add_argument("--families", default=",".join(FAMILIES), help="comma-separated subset ('' for none)")
    p.add_argument("--checks", default=",".join(CHECK_NAMES), help="comma-separated subset ('' for none)")
    p.add_argument("--steps", type=int, default=3, help="timed steps per family")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per family (the first compiles flex)")
    p.add_argument("--budget-s", type=float, default=480.0, help="the whole run stops within this")
    p.add_argument("--startup-timeout-s", type=float, default=90.0,
                   help="a worker not ready by then (device, process group, synthetic data) runs nothing")
    p.add_argument("--family-timeout-s", type=float, default=55.0, help="a family unit is stopped after this")
    p.add_argument("--check-timeout-s", type=float, default=None,
                   help="a check unit is stopped after this (default: each check's own, "
                        + ", ".join(f"{c.name} {c.timeout_s:.0f} s" for c in ALL_CHECKS) + ")")
    p.add_argument("--peak-tflops", type=float, default=None, help="device dense bf16 peak (default: by name)")
    p.add_argument("--json", default=None, help="write the report here (rewritten as each unit finishes)")
    p.add_argument("--worker-units", default=None, help=argparse.SUPPRESS)  # set by the supervisor
    p.add_argument("--worker-events", default=None, help=argparse.SUPPRESS)
    for name, default in (("hidden", 4096), ("heads", 32), ("kv-heads", 8), ("intermediate", 12288),
                          ("vocab", 151936), ("draft-vocab", 32000), ("seq-len", 2048), ("batch", 1), ("layers", 5),
                          ("peagle-layers", 4), ("ttt-steps", 7), ("num-depths", 8), ("num-anchors", 512),
                          ("context-layers", 5), ("markov-rank", 256), ("gru-hidden", 1024), ("emb-dim", 256),
                          ("seed", 0)):
        p.add_argument(f"--{name}", type=int, default=default)
    args = p.parse_args(argv)
    if args.tiny:
        for key, value in TINY.items():
            if getattr(args, key) == p.get_default(key):
                setattr(args, key, value)
    args.family_list = _subset(p, "families", args.families, FAMILIES)
    args.check_list = _subset(p, "checks", args.checks, CHECK_NAMES)
    if not args.family_list and not args.check_list:
        p.error("--families and --checks: both empty, expected at least one unit to run")
    for key in ("steps", "hidden", "heads", "kv_heads", "seq_len", "batch", "layers"):
        if getattr(args, key) < 1:
            p.error(f"--{key.replace('_', '-')}: got {getattr(args, key)}, expected >= 1")
    for key in ("budget_s", "startup_timeout_s", "family_timeout_s", "check_timeout_s"):
        if getattr(args, key) is not None and not getattr(args, key) > 0:
            p.error(f"--{key.replace('_', '-')}: got {getattr(args, key)}, expected > 0")
    # what the benchmark adapters read besides the shapes
    args.ttt_decay, args.block_size, args.loss_gamma, args.cod_ratio, args.cod_ratio_min = 0.8, None, None, 0.7, 0.2
    args.prompt_frac = 0.2
    return args


def trained_as(row: dict[str, Any]) -> list[dict[str, Any]]:
    """The rows of the known families that train as this row's family (eagle2 from eagle1's row)."""
    if row["kind"] != "family":
        return []
    return [{**row, "unit": n, "same_as": row["unit"]} for n in known_families()
            if n not in FAMILIES and catalog_entry(n).trains_as == row["unit"]]


def print_table(report: Report) -> None:
    h = report.header
    print(f"device {h.get('device', '?')}, backend {h.get('backend', '?')}, world {h.get('world', '?')}, "
          f"torch {h.get('torch', '?')}")
    print(f"{'unit':<14} {'params':>13} {'step ms':>9} {'peak GiB':>9} {'TFLOP/step':>11} {'TFLOP/s':>8} "
          f"{'MFU':>6} {'masks':>6} {'flex calls':>10} {'flex diff':>9}  status")
    for r in report.rows:
        name = r["unit"] + ("*" if r.get("same_as") else "")
        if r["kind"] != "family" or r["status"] not in ("ok", "fail"):
            print(f"{name:<14} {r['status'].upper():>6}  {r.get('detail') or r.get('error') or ''}")
            continue
        peak = "n/a" if r["peak_gib"] is None else f"{r['peak_gib']:.1f}"
        mfu = "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
        diff = f"{r['flex_max_diff']:.1e}" if r["flex_calls"] else "-"
        print(f"{name:<14} {r['trainable_params']:>13,} {r['step_ms']:>9.1f} {peak:>9} "
              f"{r['flops_per_step'] / 1e12:>11.4g} {r['tflops_per_s']:>8.4g} {mfu:>6} {len(r['masks']):>6} "
              f"{r['flex_calls']:>10} {diff:>9}  {r['status'].upper()}")
    print("* trains as the named family: its row is that family's step (eagle2: eagle1's weights; the tree "
          "is chosen at decoding time)")


def _terminate(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through supervise, which kills the worker's process group


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker_units is not None:
        from benchmarks.device_check_worker import run_worker

        return run_worker(args, args.worker_units.split(","), Path(args.worker_events))
    forwarded = list(sys.argv[1:] if argv is None else argv)

    def spawn(names: list[str], events: Path) -> subprocess.Popen[bytes]:
        cmd = [sys.executable, str(Path(__file__).resolve()), *forwarded,
               "--worker-units", ",".join(names), "--worker-events", str(events)]
        return subprocess.Popen(cmd, start_new_session=True)

    signal.signal(signal.SIGTERM, _terminate)
    units = ([Unit(f, "family", args.family_timeout_s) for f in args.family_list]
             + [Unit(c, "check", args.check_timeout_s or CHECKS[c].timeout_s) for c in args.check_list])
    report = Report(Path(args.json) if args.json else None, args.budget_s, on_row=trained_as)
    with tempfile.TemporaryDirectory(prefix="gpu_check_") as work:
        supervise(units, spawn, Path(work), report, args.startup_timeout_s)
    report.write(complete=True)
    print_table(report)
    wall = time.perf_counter() - report.started
    within = wall <= args.budget_s
    print(f"total {wall:.1f} s (budget {args.budget_s:.0f} s: {'within' if within else 'EXCEEDED'})")
    return 0 if within and all(r["ok"] for r in report.rows) else 1


if __name__ == "__main__":
    sys.exit(main())
