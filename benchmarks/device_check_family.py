"""One drafter family's training step on one device: the family unit of scripts/gpu_check.py.

The family is built as scripts/bench_train_step.py builds it (benchmarks/: the synthetic target and
batch of `make_data`, the adapters' `our_config`; EAGLE-1 and Domino, which speculators lacks, here),
sharded with the trainer's `apply_fsdp` (float32 master weights, bf16 compute) and stepped with the
trainer's `train_step` (forward, loss, backward, clip, AdamW). `run_family`:
1. a counting pass (attention answered by its query: benchmarks/attention_checks.py) under torch's
   FlopCounterMode: the step's masks and non-attention FLOPs; attention FLOPs from the masks;
2. every distinct mask checked on the device: flex's element mask and BlockMask against the dense
   mask, flex attention against SDPA;
3. --warmup steps (the first compiles flex; each of its flex calls compared with float32 SDPA over the
   dense mask), then --steps timed steps: median step time, peak memory of the timed steps, model FLOP
   utilisation = FLOPs per step / step time / the device's dense bf16 peak (--peak-tflops).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import math
import statistics
import time
from typing import Any

import torch

from benchmarks import attention_checks as checks
from benchmarks.train_step_adapters import ADAPTERS
from benchmarks.train_step_common import Data

PEAK_BF16_TFLOPS = (("H100 PCIe", 756.0), ("H100", 989.4), ("H200", 989.4))  # dense, per NVIDIA's datasheets


def family_config(name: str, args: argparse.Namespace, backend: str) -> Any:
    """The family's drafter config at the check's shapes, with `attn_backend=backend`."""
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
    """The device's dense bf16 FLOP/s (--peak-tflops, else by CUDA device name); None when unknown."""
    if args.peak_tflops is not None:
        return float(args.peak_tflops) * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    return next((tf * 1e12 for key, tf in PEAK_BF16_TFLOPS if key in name), None)


def run_family(name: str, args: argparse.Namespace, data: Data, device: torch.device) -> dict[str, Any]:
    """One family's counting pass, mask checks, warmup and timed steps; the result row (`ok`: verdict)."""
    from torch.utils.flop_counter import FlopCounterMode

    from drafters import get_family
    from drafters.common.contract import StoreStats
    from drafters.common.vocab import token_counts_from_samples
    from verl_speco.train.config import OptimConfig
    from verl_speco.train.data import to_device
    from verl_speco.train.distributed import apply_fsdp
    from verl_speco.train.optim import build_optimizer
    from verl_speco.train.step import synchronize, train_step

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
    row = {"trainable_params": params, "step_ms": 1e3 * step_s,
           "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None,
           "flops_per_step": flops, "tflops_per_s": flops / step_s / 1e12,
           "mfu": flops / step_s / peak if peak else None, "losses": losses,
           "masks": [dataclasses.asdict(c) | {"ok": c.ok} for c in mask_checks],
           "flex_calls": flex.calls, "flex_dtypes": sorted(flex.dtypes), "flex_max_diff": flex.max_diff,
           "flex_failures": flex.failures}
    row["ok"] = verdict(row, device)
    del model, optimizer
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return row


def verdict(row: dict[str, Any], device: torch.device) -> bool:
    """Finite losses, every mask check passed, FLOPs counted; on CUDA the step ran flex attention in
    bf16 and every flex call matched the dense mask."""
    ok = all(math.isfinite(x) for x in row["losses"]) and bool(row["masks"]) and all(m["ok"] for m in row["masks"])
    if device.type == "cuda":
        ok = ok and row["flex_calls"] > 0 and row["flex_dtypes"] == ["bfloat16"] and row["flex_failures"] == 0
    return ok and row["flops_per_step"] > 0
