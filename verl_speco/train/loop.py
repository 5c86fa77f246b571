"""The standalone trainer: build everything from a `TrainerConfig`, train, evaluate, checkpoint.

Per optimizer step: lr from the schedule -> `grad_accum` micro-batches of this rank's reader
stream -> `step.train_step` (global-batch normalisation, clipping, non-finite skip) -> metrics
(JSONL / TensorBoard / progress bar on rank 0) -> eval every `eval_every` steps and at the last
step -> checkpoint every `save_every` steps and at the end of the invocation (`total_steps`, or
`stop_after` steps after the start). `run.resume` restores weights, optimizer, RNG, the data
cursor and the counters, so the continued run equals an uninterrupted one."""

from __future__ import annotations

import dataclasses
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch import Tensor

from drafters import get_family
from drafters.common.contract import DrafterFamily, StoreStats
from drafters.common.target import TargetHead
from drafters.common.vocab import token_counts_from_samples
from feature_store import StoreIndex
from verl_speco.train import checkpoint as ckpt
from verl_speco.train.config import TrainerConfig, build_family_config, warmup_steps
from verl_speco.train.data import (
    eval_batches,
    micro_batches,
    open_eval_index,
    open_train_reader,
    train_shard_set,
)
from verl_speco.train.distributed import DTYPES, apply_fsdp, init_distributed
from verl_speco.train.metrics_log import MetricsLogger
from verl_speco.train.optim import build_optimizer, lr_at, set_lr
from verl_speco.train.rng import seed_everything
from verl_speco.train.step import evaluate, train_step


def store_stats(cfg: TrainerConfig, fam_cfg: Any, vocab_size: int, shard_set: dict[str, int] | None,
                device: torch.device) -> StoreStats | None:
    """Token counts over the training shards when the family asks for a reduced draft vocab
    (rank 0 counts, then broadcasts)."""
    vd = getattr(fam_cfg, "draft_vocab_size", None)
    if vd is None or vd >= vocab_size:
        return None
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    if dist.get_rank() == 0:
        index = StoreIndex.open(cfg.data.store, shard_set=shard_set)
        counts = token_counts_from_samples((index.sample(g) for g in range(index.num_samples)), vocab_size)
        index.close()
    counts = counts.to(device)
    dist.broadcast(counts, src=0)
    return StoreStats(token_counts=counts.cpu())


def _make_export_fn(cfg: TrainerConfig, family: DrafterFamily, fam_cfg: Any, target: TargetHead,
                    stats: StoreStats | None) -> ckpt.ExportFn:
    formats = list(cfg.drafter.export_formats)

    def export(full_state: dict[str, Tensor], out_dir: Path) -> None:
        with torch.random.fork_rng(devices=[]):  # building a model must not move the training RNG
            model = family.build(fam_cfg, target, stats)
        model.load_state_dict(full_state)
        model.to(DTYPES[cfg.run.dtype])
        if not formats:
            family.export(model, fam_cfg, target.spec, out_dir)
        for fmt in formats:
            family.export(model, fam_cfg, target.spec, out_dir / fmt if len(formats) > 1 else out_dir, fmt)

    return export


def run(cfg: TrainerConfig, on_step: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    """Train according to `cfg`; returns a summary (final step, last losses, skipped steps, ...).
    `on_step(step, total_steps)` is called after every optimizer step (an application's progress bar)."""
    device, created = init_distributed(cfg)
    try:
        return _run(cfg, device, on_step)
    finally:
        if created:
            dist.destroy_process_group()


def _run(cfg: TrainerConfig, device: torch.device,
         on_step: Callable[[int, int], None] | None = None) -> dict[str, Any]:
    rank, world = dist.get_rank(), dist.get_world_size()
    out_dir = Path(cfg.run.out_dir)
    seed_everything(cfg.run.seed)  # identical on every rank: the same initial weights everywhere
    family = get_family(cfg.drafter.family)
    fam_cfg = build_family_config(family.config_cls, dict(cfg.drafter.settings), cfg.drafter.family)
    target = TargetHead.from_pretrained(cfg.target.path)
    layout, fields = family.required_layout(fam_cfg, target.spec), tuple(family.required_fields(fam_cfg))
    shard_set, held = train_shard_set(cfg.data)
    reader = open_train_reader(cfg.data, rank, world, layout, fields, shard_set)
    eval_index = open_eval_index(cfg.data, held, layout, fields)
    stats = store_stats(cfg, fam_cfg, target.spec.vocab_size, shard_set, device)
    model = family.build(fam_cfg, target, stats).to(device=device, dtype=DTYPES[cfg.run.dtype])
    apply_fsdp(model, device, cfg.run.mixed_precision, cfg.dist.reshard_after_forward)
    optimizer = build_optimizer(model.parameters(), cfg.optim)
    seed_everything(cfg.run.seed + 1_000_003 * rank)  # per-rank stream for stochastic objectives

    ckpt_root = out_dir / "ckpt"
    step, skipped, tokens_seen = 0, 0, 0
    resume_from = ckpt.resolve_resume(cfg.run.resume, ckpt_root, warn=rank == 0)
    if resume_from is None:
        _fresh_out_dir(out_dir, ckpt_root, cfg.run.overwrite)
    if resume_from is not None:
        state = ckpt.load_checkpoint(resume_from, model, optimizer)
        reader.load_state_dict(state["reader"])
        step, skipped, tokens_seen = state["step"], state["skipped_steps"], state["tokens_seen"]
    total = cfg.run.total_steps
    stop_at = total if cfg.run.stop_after is None else min(total, step + cfg.run.stop_after)
    warmup = warmup_steps(cfg)
    logger = MetricsLogger(out_dir, rank == 0, step, total, cfg.run.tensorboard, cfg.run.progress_bar)
    export_fn = _make_export_fn(cfg, family, fam_cfg, target, stats)
    resolved = OmegaConf.to_container(OmegaConf.structured(cfg))
    stream = micro_batches(reader, cfg.data, layout)
    last: dict[str, Any] = {"resumed_from": str(resume_from) if resume_from else None, "step": step}
    model.train()
    while step < stop_at:
        lr = lr_at(step, cfg.optim, total, warmup)
        set_lr(optimizer, lr)
        t0 = time.perf_counter()
        micro = [next(stream) for _ in range(cfg.optim.grad_accum)]  # reading + decoding store shards
        t_read = time.perf_counter() - t0
        res = train_step(model, family, micro, optimizer, cfg.optim.grad_clip, device, cfg.optim.denominators,
                         progress=min(1.0, step / max(1, total)))  # training done so far (curricula)
        dt = time.perf_counter() - t0
        step, skipped, tokens_seen = step + 1, skipped + int(res.skipped), tokens_seen + res.tokens
        record = {"loss": res.loss, "lr": lr, "grad_norm": res.grad_norm, "skipped": int(res.skipped),
                  "skipped_steps": skipped, "tokens": res.tokens, "tokens_per_s": res.tokens / max(dt, 1e-9),
                  "step_time_s": dt, "time_read_s": t_read, **{f"time_{k}_s": v for k, v in res.timing.items()},
                  **res.metrics}
        if step % cfg.run.log_every == 0 or res.skipped or step == stop_at:
            logger.log(step, "train", record)
        logger.advance()
        if on_step is not None:
            on_step(step, total)
        last.update(step=step, loss=res.loss, skipped_steps=skipped)
        if eval_index is not None and ((cfg.run.eval_every and step % cfg.run.eval_every == 0) or step == total):
            ev = evaluate(model, family, eval_batches(eval_index, cfg.data, rank, world, layout), device)
            if ev:
                logger.log(step, "eval", ev)
                last["eval"] = ev
        if (cfg.run.save_every and step % cfg.run.save_every == 0) or step == stop_at:
            state = {"skipped_steps": skipped, "tokens_seen": tokens_seen, "config": resolved,
                     "drafter_config": _jsonable(fam_cfg),
                     "scheduler": {"schedule": cfg.optim.schedule, "warmup_steps": warmup, "total_steps": total,
                                   "next_step": step, "next_lr": lr_at(step, cfg.optim, total, warmup)}}
            last["checkpoint"] = str(ckpt.save_checkpoint(ckpt_root, step, model, optimizer, reader.state_dict(),
                                                          state, export_fn, cfg.run.keep_last))
    logger.close()
    reader.close()
    return last


def _fresh_out_dir(out_dir: Path, ckpt_root: Path, overwrite: bool) -> None:
    """A fresh run must not mix with an earlier run's checkpoints (resume=true would pick them)."""
    ckpt.check_fresh_out_dir(out_dir, overwrite)
    dist.barrier()
    if overwrite and dist.get_rank() == 0:
        ckpt.clear_checkpoints(ckpt_root)
        shutil.rmtree(out_dir / "tensorboard", ignore_errors=True)
    dist.barrier()


def _jsonable(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: _jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, (list, tuple)):
        return [_jsonable(v) for v in obj]
    return obj
