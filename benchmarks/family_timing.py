"""The family comparison's timing pass (`scripts/bench_family_acceptance.py`, its docstring's "training
step time"): every trained family's model, optimizer and one fixed micro-batch built as the trainer
builds them, stepped round-robin; trainable parameters and the median step CPU / wall time."""

from __future__ import annotations

import argparse
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _timing_setup(args: argparse.Namespace, family: str, config_overrides: Callable[[str], list[str]]) -> dict[str, Any]:
    """What the trainer builds for `family` (the trainer overrides `config_overrides(family)` gives:
    preset + the benchmark's, run dir <out>/timing): model (FSDP-wrapped,
    as `verl_speco.train.loop`), AdamW, and one fixed micro-batch copied out of the store (the
    first of the seeded stream: the same samples for every family); the default process group
    must exist."""
    from drafters import get_family
    from drafters.common.target import TargetHead
    from verl_speco.train.compose import load_config
    from verl_speco.train.config import build_family_config
    from verl_speco.train.data import micro_batches, open_train_reader
    from verl_speco.train.distributed import DTYPES, apply_fsdp, resolve_device
    from verl_speco.train.loop import store_stats
    from verl_speco.train.optim import build_optimizer
    from verl_speco.train.rng import seed_everything

    cfg = load_config(config_overrides(family))
    device = resolve_device(cfg.run.device)
    seed_everything(cfg.run.seed)
    fam = get_family(cfg.drafter.family)
    fam_cfg = build_family_config(fam.config_cls, dict(cfg.drafter.settings), cfg.drafter.family)
    head = TargetHead.from_pretrained(cfg.target.path)
    layout, fields = fam.required_layout(fam_cfg, head.spec), tuple(fam.required_fields(fam_cfg))
    reader = open_train_reader(cfg.data, 0, 1, layout, fields, None)
    try:
        stream = micro_batches(reader, cfg.data, layout)
        # copied: the samples are views of the shards, which die with the reader
        micro = [[{k_: v.clone() for k_, v in sample.items()} for sample in next(stream)]
                 for _ in range(cfg.optim.grad_accum)]
    finally:
        reader.close()
    stats = store_stats(cfg, fam_cfg, head.spec.vocab_size, None, device)
    model = fam.build(fam_cfg, head, stats).to(device=device, dtype=DTYPES[cfg.run.dtype])
    counts = {"trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
              "frozen_params": sum(p.numel() for p in model.parameters() if not p.requires_grad),
              "buffer_elements": sum(b.numel() for b in model.buffers())}
    apply_fsdp(model, device, cfg.run.mixed_precision, cfg.dist.reshard_after_forward)
    optimizer = build_optimizer(model.parameters(), cfg.optim)
    model.train()
    return {"cfg": cfg, "device": device, "family": fam, "model": model, "optimizer": optimizer, "micro": micro,
            "counts": counts, "times": [], "cpu": [], "stages": [], "tokens": 0}


def time_families(args: argparse.Namespace, trained: dict[str, dict[str, Any]],
                  config_overrides: Callable[[str], list[str]], out: Path,
                  tick: Callable[[], None] | None = None) -> dict[str, dict[str, Any]]:
    """Trainable parameters and training step time of every trained family (module docstring: the
    timing pass). After all training; the families' models are built side by side and stepped
    round-robin (--time-warmup steps each, then --time-steps rounds of one step per family), so a
    change of machine load over the pass falls on every family alike. Each step's process CPU time
    (`time.process_time`) and wall time are recorded with torch at --time-threads intra-op threads
    (default 1: the CPU time of a 1-thread step is its work, whatever else runs on a shared machine;
    the wall time of a multi-threaded step there is not); the medians per family are reported.
    Cached in <out>/timing_k<k>.json, keyed by the families' training settings and the pass's.
    `config_overrides(family)`: the family's trainer overrides; `tick()` after each timed round."""
    import statistics
    import time

    import torch
    import torch.distributed as dist

    from verl_speco.train.step import train_step

    key = [[f, t["key"]] for f, t in sorted(trained.items())] + [args.time_warmup, args.time_steps,
                                                                 args.time_threads]
    cache = out / f"timing_k{args.k}.json"
    if not args.retime and cache.is_file() and json.loads(cache.read_text())["key"] == key:
        cached: dict[str, dict[str, Any]] = json.loads(cache.read_text())["result"]
        return cached
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    load_before = os.getloadavg()
    threads = torch.get_num_threads()
    torch.set_num_threads(args.time_threads)
    try:
        with torch.random.fork_rng(devices=[]):
            setups = {f: _timing_setup(args, f, config_overrides) for f in trained}

            def step(su: dict[str, Any]) -> None:
                cfg = su["cfg"]
                t0, c0 = time.perf_counter(), time.process_time()
                res = train_step(su["model"], su["family"], su["micro"], su["optimizer"], cfg.optim.grad_clip,
                                 su["device"], cfg.optim.denominators, progress=0.0)
                su["cpu"].append(time.process_time() - c0)
                su["times"].append(time.perf_counter() - t0)
                su["stages"].append(res.timing)
                su["tokens"] = res.tokens

            for su in setups.values():
                for _ in range(args.time_warmup):
                    step(su)
                su["times"].clear()
                su["cpu"].clear()
                su["stages"].clear()
            for _ in range(args.time_steps):
                for su in setups.values():
                    step(su)
                if tick is not None:
                    tick()
    finally:
        torch.set_num_threads(threads)
        if created:
            dist.destroy_process_group()
    load_after = os.getloadavg()
    result: dict[str, dict[str, Any]] = {}
    for fam, su in setups.items():
        times, cpu, stages = su["times"], su["cpu"], su["stages"]
        result[fam] = {
            **su["counts"],
            "step_ms_median": 1000 * statistics.median(cpu), "step_ms_min": 1000 * min(cpu),
            "step_ms_max": 1000 * max(cpu), "step_ms_measure": "process CPU time",
            "wall_ms_median": 1000 * statistics.median(times), "wall_ms_min": 1000 * min(times),
            "wall_ms_max": 1000 * max(times),
            "stage_wall_ms_median": {s: 1000 * statistics.median(t[s] for t in stages) for s in stages[0]},
            "timed_steps": len(times), "warmup_steps": args.time_warmup, "batch_tokens": su["tokens"],
            "batch_sequences": sum(len(m) for m in su["micro"]), "torch_threads": args.time_threads,
            "cpu_count": os.cpu_count(), "loadavg_1min_before_after": [load_before[0], load_after[0]],
            "cpu_ms_all": [1000 * t for t in cpu], "wall_ms_all": [1000 * t for t in times]}
        print(f"[bench] timing {fam}: {result[fam]['trainable_params']:,} trainable params, "
              f"{result[fam]['step_ms_median']:.0f} CPU ms/step (median of {len(times)}, min "
              f"{result[fam]['step_ms_min']:.0f}; wall median {result[fam]['wall_ms_median']:.0f}; "
              f"{su['tokens']} tokens)", flush=True)
    cache.write_text(json.dumps({"key": key, "result": result}))
    return result

