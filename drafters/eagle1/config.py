"""EAGLE-1 drafter configuration (docs/design/algorithms.md section 1; docs/design/engines.md sections 2.1, 4.2).

The draft's sizes (hidden, heads, kv heads, head_dim, intermediate, rope_theta, eps) are the
target's: one Llama decoder layer without its input norm, over `fc(cat[embed(x_{t+1}); f_t])`.
Only the training choices below are settings. There is nothing to resolve from the target
(no aux layers, no draft vocab): `resolve` exists so callers treat every family alike.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from drafters.common.attention import BACKENDS
from drafters.common.chunked_head import DEFAULT_LOSS_CHUNK_ROWS, check_chunk_rows
from drafters.common.target import TargetSpec


@dataclass(frozen=True)
class Eagle1Config:
    """
    feature_noise: scale of the uniform noise added to the INPUT features in training mode:
        (U[0,1) - 0.5) * feature_noise * 512 / seq_len (SafeAILab `AddUniformNoise`, std 0.2);
        0 disables it. Never applied in eval mode nor to the regression targets.
    value_weight: weight of the SmoothL1 feature-regression term (v_w = 1.0).
    prob_weight: weight of the soft cross-entropy term through the frozen target head (p_w = 0.1).
    attn_backend: "auto" (flex on CUDA, else SDPA), "sdpa" or "flex".
    loss_chunk_rows: loss rows per chunk of the LM head + loss (drafters/common/chunked_head.py): at
        most this many rows of [rows, vocab] logits are alive at once; the loss does not depend on it.
    """

    feature_noise: float = 0.2
    value_weight: float = 1.0
    prob_weight: float = 0.1
    attn_backend: str = "auto"
    loss_chunk_rows: int = DEFAULT_LOSS_CHUNK_ROWS

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
