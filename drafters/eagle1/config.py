"""EAGLE-1 drafter configuration (docs/design/algorithms.md section 1; docs/design/engines.md sections 2.1, 4.2):
one Llama decoder layer without input norm over `fc(cat[embed(x_{t+1}); f_t])`, sized as the target."""

from __future__ import annotations

import math
from dataclasses import dataclass

from drafters.common.attention import BACKENDS
from drafters.common.chunked_head import DEFAULT_LOSS_CHUNK_ROWS, check_chunk_rows
from drafters.common.target import TargetSpec


@dataclass(frozen=True)
class Eagle1Config:
    """The EAGLE-1 training choices (the sizes are the target's)."""

    feature_noise: float = 0.2  # (U[0,1) - 0.5) * noise * 512 / seq_len on the INPUT features, training only
    value_weight: float = 1.0  # SmoothL1 feature-regression term
    prob_weight: float = 0.1  # soft CE through the frozen target head
    attn_backend: str = "auto"  # "auto" (flex on CUDA, else SDPA), "sdpa" or "flex"
    loss_chunk_rows: int = DEFAULT_LOSS_CHUNK_ROWS  # rows of logits alive at once (common/chunked_head.py)

    def __post_init__(self) -> None:
        check_chunk_rows(self.loss_chunk_rows)
        for name in ("feature_noise", "value_weight", "prob_weight"):
            value = float(getattr(self, name))
            if not math.isfinite(value) or value < 0:
                raise ValueError(f"{name}: got {value}, expected a finite number >= 0")
        if self.value_weight == 0 and self.prob_weight == 0:
            raise ValueError("value_weight and prob_weight: both 0, expected at least one > 0")
        if self.attn_backend not in BACKENDS:
            raise ValueError(f"attn_backend: got {self.attn_backend!r}, expected one of {BACKENDS}")

    def resolve(self, target_spec: TargetSpec) -> Eagle1Config:
        """Check the target can be served: an EAGLE-1 draft shares its embedding and LM head."""
        if target_spec.hidden_size < 1 or target_spec.vocab_size < 1:
            raise ValueError(f"target: hidden_size={target_spec.hidden_size}, vocab_size={target_spec.vocab_size}")
        return self
