"""Types shared by every family and by the reference decoder (docs/internals.md, drafters section).

- `StoreStats`: what `build` may read from the training data (token counts for vocab selection).
- `DraftContext` / `Proposal` / `Proposer`: the interface between `drafters.spec_decode` and a
  family's drafting code.
- `DrafterFamily`: the protocol every catalog entry implements.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch
from torch import Tensor, nn

from drafters.common.losses import ObjectiveOutput
from drafters.common.sampling import SamplingParams
from drafters.common.target import TargetHead, TargetSpec
from feature_store import Layout


@dataclass(frozen=True)
class StoreStats:
    """token_counts: int64 [V], counts of target ids over loss-masked tokens (see common/vocab.py)."""

    token_counts: Tensor | None = None


@dataclass
class DraftContext:
    """What a proposer sees at the start of a round (one sequence).

    token_ids: int64 [n + 1], committed tokens x_0..x_n; x_n was just emitted by the target and
        has no target features yet.
    target_hidden_states: the target's HF `hidden_states` (L + 1 tensors, each [n, H_t]) at
        positions 0..n-1; entry 0 is the embedding output, entry L is post-final-norm.
    """

    token_ids: Tensor
    target_hidden_states: tuple[Tensor, ...]


@dataclass
class Proposal:
    """token_ids: int64 [k] draft tokens as TARGET ids; probs: float [k, V] the draft
    distribution each was drawn from (target vocab), or None for greedy drafting (q one-hot)."""

    token_ids: Tensor
    probs: Tensor | None


class Proposer(Protocol):
    def propose(self, ctx: DraftContext, num_tokens: int, sampling: SamplingParams,
                generator: torch.Generator | None = None) -> Proposal:
        """Draft `num_tokens` tokens continuing ctx.token_ids; greedy when `sampling.greedy`."""
        ...


class DrafterFamily(Protocol):
    @property
    def name(self) -> str: ...

    @property
    def config_cls(self) -> type: ...

    def build(self, cfg: Any, target: TargetHead, store_stats: StoreStats | None = None) -> nn.Module: ...

    def required_fields(self, cfg: Any) -> tuple[str, ...]: ...

    def required_layout(self, cfg: Any, target_spec: TargetSpec) -> Layout: ...

    def collate(self, samples: list[dict[str, Tensor]]) -> dict[str, Tensor]: ...

    def objective(self, model: nn.Module, batch: dict[str, Tensor]) -> ObjectiveOutput: ...

    def export(self, model: nn.Module, cfg: Any, target_spec: TargetSpec, out_dir: str | Path,
               fmt: str = "native", **kwargs: Any) -> Path: ...

    def proposer(self, model: nn.Module, target_spec: TargetSpec) -> Proposer: ...
