"""AdamW and the warmup + decay learning-rate schedule (a pure function of the step counter).

The schedule keeps no state besides the step counter, so resuming only needs the step:
`lr_at(step)` for optimizer step `step` (0-based, the step about to be taken):
  - warmup (step < W): lr * (step + 1) / W
  - decay over the remaining `total - W` steps, progress p = (step - W) / max(1, total - W - 1):
    cosine: lr * (m + (1 - m) * (1 + cos(pi * p)) / 2); linear: lr * (1 - (1 - m) * p);
    constant: lr; with m = min_lr_ratio, so the last step runs at exactly lr * m."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import nn

from verl_speco.train.config import OptimConfig


def build_optimizer(params: Iterable[nn.Parameter], cfg: OptimConfig) -> torch.optim.AdamW:
    """AdamW over the trainable parameters (both the standalone trainer and the online drafter)."""
    trainable = [p for p in params if p.requires_grad]
    if not trainable:
        raise ValueError("the drafter has no trainable parameters (every parameter has "
                         "requires_grad=False)")
    return torch.optim.AdamW(trainable, lr=cfg.lr, betas=(cfg.betas[0], cfg.betas[1]), eps=cfg.eps,
                             weight_decay=cfg.weight_decay)


def warmup_lr(step: int, lr: float, warmup: int) -> float:
    """The warmup phase, lr * (step + 1) / W while step < W, then lr (the online drafter's whole
    schedule: it has no planned total)."""
    return lr * (step + 1) / warmup if warmup > 0 and step < warmup else lr


def lr_at(step: int, cfg: OptimConfig, total_steps: int, warmup: int) -> float:
    """Learning rate of optimizer step `step` (0-based)."""
    if warmup > 0 and step < warmup:
        return warmup_lr(step, cfg.lr, warmup)
    if cfg.schedule == "constant":
        return cfg.lr
    span = max(1, total_steps - warmup - 1)
    progress = min(1.0, max(0.0, (step - warmup) / span))
    m = cfg.min_lr_ratio
    if cfg.schedule == "cosine":
        return cfg.lr * (m + (1.0 - m) * 0.5 * (1.0 + math.cos(math.pi * progress)))
    if cfg.schedule == "linear":
        return cfg.lr * (1.0 - (1.0 - m) * progress)
    raise ValueError(f"optim.schedule={cfg.schedule!r}: expected cosine, linear or constant")


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr
