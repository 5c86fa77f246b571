"""Masked loss pieces returned as (numerator, denominator) sums, and `ObjectiveOutput`.

The loss of a global batch is `sum_s w_s * sum(num_s) / sum(den_s)` over every micro-batch and rank: the
trainer all-reduces the denominators, so 1 and N processes give the same loss (docs/internals.md)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass
class ObjectiveOutput:
    """One micro-batch's S loss terms (EAGLE-3: one per TTT step): numerators [S] (differentiable sums
    over masked rows), denominators [S] and weights [S] (no grad), metrics name -> (sum, count)."""

    numerators: Tensor
    denominators: Tensor
    weights: Tensor
    metrics: dict[str, tuple[Tensor, Tensor]] = field(default_factory=dict)

    def loss(self, denominators: Tensor | None = None) -> Tensor:
        """sum_s w_s * num_s / den_s, with `denominators` the global ones when given (default: this
        micro-batch's). A term whose denominator is 0 contributes 0."""
        den = self.denominators if denominators is None else denominators
        den = den.to(self.numerators)
        safe = torch.where(den > 0, den, torch.ones_like(den))
        per_term = torch.where(den > 0, self.numerators / safe, torch.zeros_like(self.numerators))
        return (self.weights.to(per_term) * per_term).sum()

    def metric_values(self) -> dict[str, float]:
        """Local sum / count per metric (NaN when count is 0)."""
        return {k: (float(s) / float(c)) if float(c) > 0 else float("nan") for k, (s, c) in self.metrics.items()}


def geometric_weights(num_terms: int, decay: float) -> Tensor:
    """[decay^0, decay^1, ..., decay^(S-1)], float32 [S] (EAGLE-3: decay 0.8)."""
    if num_terms < 1:
        raise ValueError(f"num_terms: got {num_terms}, expected >= 1")
    return decay ** torch.arange(num_terms, dtype=torch.float32)


def masked_match_count(pred: Tensor, target: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """(number of masked rows with pred == target, number of masked rows); pred/target/mask [...]."""
    m = mask.to(torch.bool)
    return ((pred == target) & m).sum().float(), m.sum().float()


def smooth_l1_rows(pred: Tensor, target: Tensor, mask: Tensor, beta: float = 1.0) -> tuple[Tensor, Tensor]:
    """sum over rows of mask * mean_h SmoothL1(pred, target), and sum(mask) (EAGLE-1's v-loss, as
    torch.nn.SmoothL1Loss). pred, target [..., H] (target no grad), mask [...] -> (numerator, denominator)."""
    if pred.shape != target.shape:
        raise ValueError(f"pred {tuple(pred.shape)} vs target {tuple(target.shape)}")
    per_row = torch.nn.functional.smooth_l1_loss(pred.float(), target.float(), reduction="none", beta=beta).mean(-1)
    m = mask.to(per_row.dtype)
    return (per_row * m).sum(), m.sum().detach()
