"""P-EAGLE drafter configuration (docs/design/algorithms.md section 7; docs/design/engines.md section 2.3.1):
EAGLE-3's architecture plus the mask token and K, the depths drafted in one forward."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Self

from drafters.common.target import TargetSpec
from drafters.eagle3.config import Eagle3Architecture


@dataclass(frozen=True)
class PEagleConfig(Eagle3Architecture):
    """`Eagle3Architecture` (4 layers, SpecForge's Qwen3-8B recipe) plus parallel drafting and COD."""

    num_layers: int = 4
    num_depths: int = 8  # K drafted per forward (depth 0 = the EAGLE-3 row); vLLM's K must not exceed it
    cod_ratio: float = 0.7  # r: COD keeps about (n - d) * max(r^d, cod_ratio_min) chains at depth d
    cod_ratio_min: float = 0.2
    mask_token_id: int | None = None  # vLLM `ptd_token_id` / `mask_token_id`; None = the tokenizer's
    num_segments: int = 1  # sequence partitioning (PE-p Algorithm 1): segments recomputed in backward

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.num_depths < 1:
            raise ValueError(f"num_depths: got {self.num_depths}, expected >= 1")
        if not 0 < self.cod_ratio <= 1:
            raise ValueError(f"cod_ratio: got {self.cod_ratio}, expected in (0, 1]")
        if not 0 <= self.cod_ratio_min <= 1:
            raise ValueError(f"cod_ratio_min: got {self.cod_ratio_min}, expected in [0, 1]")
        if self.num_segments < 1:
            raise ValueError(f"num_segments: got {self.num_segments}, expected >= 1")

    def resolve(self, target_spec: TargetSpec) -> Self:
        """`Eagle3Architecture.resolve` plus the mask token (the tokenizer's when None)."""
        cfg = super().resolve(target_spec)
        mask = cfg.mask_token_id if cfg.mask_token_id is not None else target_spec.mask_token_id
        if mask is None:
            raise ValueError("mask_token_id: None and the target tokenizer has no mask token; set "
                             f"drafter.settings.mask_token_id to an id in 0..{target_spec.vocab_size - 1}")
        if not 0 <= mask < target_spec.vocab_size:
            raise ValueError(f"mask_token_id: got {mask}, expected 0..{target_spec.vocab_size - 1} (target vocab)")
        return replace(cfg, mask_token_id=int(mask))
