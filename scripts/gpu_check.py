"""GPU check (run by scripts/gpu_check.sh): one training step of every drafter family on one accelerator,
bf16 with flex attention, FSDP2 over NCCL with one rank, at Qwen3-8B draft shapes (hidden 4096, 32/8
heads, intermediate 12288, vocab 151936, draft vocab 32000; DFlash/DSpark/Domino 5 layers and 512
anchors, P-EAGLE 4 layers and 8 depths, EAGLE-3 7 TTT steps; one sequence of 2048 tokens).

Families are built as scripts/bench_train_step.py builds them (benchmarks/: the synthetic target and
batch of `make_data`, the adapters' `our_config`; EAGLE-1 and Domino, which speculators lacks, here),
sharded with the trainer's `apply_fsdp` (float32 master weights, bf16 compute) and stepped with the
trainer's `train_step` (forward, loss, backward, clip, AdamW). Per family:
1. a counting pass (attention answered by its query: benchmarks/attention_checks.py) under torch's
   FlopCounterMode: the step's masks and non-attention FLOPs; attention FLOPs from the masks;
2. every distinct mask checked on the device: flex's element mask and BlockMask against the dense
   mask, flex attention against SDPA;
3. --warmup steps (the first compiles flex; each of its flex calls compared with float32 SDPA over the
   dense mask), then --steps timed steps: median step time, peak memory of the timed steps, model FLOP
   utilisation = FLOPs per step / step time / the device's dense bf16 peak (--peak-tflops).
eagle2 is EAGLE-1's weights and objective (its tree is a decoding choice): its row is eagle1's step.
`--device cpu --tiny` runs the same path on CPU with tiny shapes and SDPA (the CI smoke run).
Exit status 0 when every check passed (finite losses, masks equal, on CUDA flex in bf16, the whole
run within --budget-s), else 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import attention_checks as checks  # noqa: E402
from benchmarks.train_step_adapters import ADAPTERS  # noqa: E402
from benchmarks.train_step_common import make_data  # noqa: E402
from drafters.registry import training_families  # noqa: E402

FAMILIES = training_families()  # the catalog's families with their own training step (eagle2 trains as eagle1)
TINY = dict(hidden=128, heads=4, kv_heads=2, intermediate=256, vocab=2048, draft_vocab=512, seq_len=128,
            layers=1, peagle_layers=2, num_anchors=8, context_layers=3, markov_rank=32, gru_hidden=64, emb_dim=64)
PEAK_BF16_TFLOPS = (("H100 PCIe", 756.0), ("H100", 989.4), ("H200", 989.4))  # dense, per NVIDIA's datasheets


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument("--tiny", action="store_true", help=f"tiny shapes (CPU smoke run): {TINY}")
    p.add_argument("--families", default=",".join(FAMILIES), help="comma-separated subset")
    p.add_argument("--steps", type=int, default=3, help="timed steps per family")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps per family (the first compiles flex)")
    p.add_argument("--budget-s", type=float, default=480.0, help="the whole run must finish within this")
    p.add_argument("--peak-tflops", type=float, default=None, help="device dense bf16 peak (default: by name)")
    p.add_argument("--json", default=None, help="also write the report here")
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
    bad = [f for f in args.families.split(",") if f not in FAMILIES]
    if bad:
        p.error(f"--families: got {bad}, expected a subset of {','.join(FAMILIES)}")
    for key in ("steps", "hidden", "heads", "kv_heads", "seq_len", "batch", "layers"):
        if getattr(args, key) < 1:
            p.error(f"--{key.replace('_', '-')}: got {getattr(args, key)}, expected >= 1")
    # what the benchmark adapters read besides the shapes
    args.ttt_decay, args.block_size, args.loss_gamma, args.cod_ratio, args.cod_ratio_min = 0.8, None, None, 0.7, 0.2
    args.prompt_frac = 0.2
    return args


def family_config(name: str, args: argparse.Namespace, backend: str) -> Any:
    if name in ADAPTERS:
        cfg = ADAPTERS[name].our_config(args)
    elif name == "eagle1":
        from drafters.eagle1 import Eagle1Config

        cfg = Eagle1Config()
    else:
        from drafters.domino import DominoConfig

        cfg = DominoConfig(num_layers=args.layers, block_size=16, target_layer_ids=tuple(range(args.context_layers)),
                           num_target_features=args.context_layers, num_anchors=args.num_anchors,
                           gru_hidden_dim=args.gru_hidden, emb_dim=args.emb_dim)
    return dataclasses.replace(cfg, attn_backend=backend)


def peak_flops(args: argparse.Namespace, device: torch.device) -> float | None:
    if args.peak_tflops is not None:
        return args.peak_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((tf * 1e12 for key, tf in PEAK_BF16_TFLOPS if key in name), None)


def run_family(name: str, args: argparse.Namespace, data: Any, device: torch.device) -> dict[str, Any]:
    from torch.utils.flop_counter import FlopCounterMode

    from drafters import get_family
    from drafters.common.contract import StoreStats
    from drafters.common.vocab import token_counts_from_samples
    from verl_speco.train.config import OptimConfig
    from verl_speco.train.data import to_device
    from verl_speco.train.distributed import apply_fsdp
    from verl_speco.train.optim import build_optimizer
    from verl_speco.train.step import synchronize, train_step

    started = time.perf_counter()
    family = get_family(name)
    cfg = family_config(name, args, "flex" if device.type == "cuda" else "sdpa")
    features = len(family.required_layout(family.resolve(cfg, data.target.spec), data.target.spec).layer_ids)
    samples = [{**s, "aux_hidden": s["aux_hidden"][:, :features * args.hidden]} for s in data.samples]
    stats = StoreStats(token_counts=token_counts_from_samples(samples, args.vocab))
    torch.manual_seed(args.seed)
    model = family.build(cfg, data.target, stats).to(device).train()
    apply_fsdp(model, device, "bfloat16", reshard_after_forward=True)
    optimizer = build_optimizer(model.parameters(), OptimConfig())
    params = sum(p.numel() for p in model.parameters() if p.requires_grad)

    with checks.record_masks() as rec, FlopCounterMode(display=False) as counter:
        family.objective(model, to_device(family.collate(samples), device), 0.5).loss().backward()
    optimizer.zero_grad(set_to_none=True)
    flops = float(counter.get_total_flops()) + checks.attention_flops(rec, device)
    mask_checks = [checks.check_mask(m, device) for m in rec.masks()]

    losses, times = [], []
    with checks.compare_flex_to_dense() as flex:
        if args.warmup:
            losses.append(train_step(model, family, [samples], optimizer, 1.0, device, progress=0.5).loss)
    for _ in range(args.warmup - 1):
        losses.append(train_step(model, family, [samples], optimizer, 1.0, device, progress=0.5).loss)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(args.steps):
        synchronize(device)
        t0 = time.perf_counter()
        losses.append(train_step(model, family, [samples], optimizer, 1.0, device, progress=0.5).loss)
        synchronize(device)
        times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    peak = peak_flops(args, device)
    row = {"family": name, "trainable_params": params, "step_ms": 1e3 * step_s,
           "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
           "flops_per_step": flops, "tflops_per_s": flops / step_s / 1e12,
           "mfu": flops / step_s / peak if peak else None, "losses": losses,
           "masks": [dataclasses.asdict(c) | {"ok": c.ok} for c in mask_checks],
           "flex_calls": flex.calls, "flex_dtypes": sorted(flex.dtypes), "flex_max_diff": flex.max_diff,
           "flex_failures": flex.failures, "wall_s": time.perf_counter() - started}
    row["ok"] = verdict(row, device)
    del model, optimizer
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def verdict(row: dict[str, Any], device: torch.device) -> bool:
    ok = all(math.isfinite(x) for x in row["losses"]) and bool(row["masks"]) and all(m["ok"] for m in row["masks"])
    if device.type == "cuda":  # the step ran flex attention in bf16 and it matched the dense masks
        ok = ok and row["flex_calls"] > 0 and row["flex_dtypes"] == ["bfloat16"] and row["flex_failures"] == 0
    return ok and row["flops_per_step"] > 0


def print_table(rows: list[dict[str, Any]], header: str) -> None:
    print(header)
    print(f"{'family':<8} {'params':>13} {'step ms':>9} {'peak GiB':>9} {'TFLOP/step':>11} {'TFLOP/s':>8} "
          f"{'MFU':>6} {'masks':>6} {'flex calls':>10} {'flex diff':>9}  check")
    for r in rows:
        peak = "n/a" if r["peak_gib"] is None else f"{r['peak_gib']:.1f}"
        mfu = "n/a" if r["mfu"] is None else f"{100 * r['mfu']:.1f}%"
        name = r["family"] if r["family"] != "eagle2" else "eagle2*"
        diff = f"{r['flex_max_diff']:.1e}" if r["flex_calls"] else "-"
        print(f"{name:<8} {r['trainable_params']:>13,} {r['step_ms']:>9.1f} {peak:>9} {r['flops_per_step'] / 1e12:>11.4g} "
              f"{r['tflops_per_s']:>8.4g} {mfu:>6} {len(r['masks']):>6} {r['flex_calls']:>10} {diff:>9}  "
              f"{'OK' if r['ok'] else 'FAIL'}")
    print("* eagle2 = eagle1's weights and training step (the tree is chosen at decoding time)")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from verl_speco.train.config import RunSection, TrainerConfig
    from verl_speco.train.distributed import init_distributed

    started = time.perf_counter()
    device, _ = init_distributed(TrainerConfig(run=RunSection(device=args.device)))
    import torch.distributed as dist

    torch.manual_seed(args.seed)
    data = make_data(args, args.context_layers, 1.0)
    rows = []
    for name in args.families.split(","):
        rows.append(run_family(name, args, data, device))
        print(f"[gpu_check] {name}: {rows[-1]['step_ms']:.1f} ms/step, {'OK' if rows[-1]['ok'] else 'FAIL'} "
              f"({rows[-1]['wall_s']:.1f} s)", flush=True)
        if name == "eagle1":
            rows.append({**rows[-1], "family": "eagle2"})
    wall = time.perf_counter() - started
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print_table(rows, f"device {name}, backend {dist.get_backend()}, world {dist.get_world_size()}, torch "
                      f"{torch.__version__}; hidden {args.hidden}, heads {args.heads}/{args.kv_heads}, vocab "
                      f"{args.vocab}, draft vocab {args.draft_vocab}, seq {args.seq_len} x {args.batch}")
    within = wall <= args.budget_s
    print(f"total {wall:.1f} s (budget {args.budget_s:.0f} s: {'within' if within else 'EXCEEDED'})")
    if args.json:
        Path(args.json).write_text(json.dumps({"device": name, "backend": dist.get_backend(), "wall_s": wall,
                                               "budget_s": args.budget_s, "rows": rows}, indent=1))
    dist.destroy_process_group()
    return 0 if within and all(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
