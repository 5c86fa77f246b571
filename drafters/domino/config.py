"""Domino drafter configuration (docs/design/algorithms.md section 6; docs/design/engines.md sections 2.6 and 4.6).

The DFlash backbone with SGLang's `shift_label` layout (slot k = 0 .. B - 2 predicts x_{a+k+1}) and a GRU
correction head (drafters/domino/model.py). Loss: sum_k w_k [(1 - lam) CE(final_k) + lam CE(U_k)] / sum_k w_k,
w_k = exp(-k / gamma), lam the base-anchored curriculum (`curriculum_lambda`)."""

from __future__ import annotations

from dataclasses import dataclass

from drafters.dflash.config import DFlashConfig

PURE_DRAFT_PREFIX_LEN = 1  # SGLang requires exactly 1: slot 0 keeps the base logits


@dataclass(frozen=True)
class DominoConfig(DFlashConfig):
    """DFlashConfig's fields (block_size B: B - 1 drafts per block) plus the GRU head and its curriculum."""

    gru_hidden_dim: int = 1024  # G, the prefix GRU's state (SpecForge Qwen3-8B)
    emb_dim: int = 256  # E, embed_proj's inner width
    lambda_start: float = 1.0  # initial weight of the base-logit CE (1.0: all on the backbone)
    lambda_decay_fraction: float = 0.5  # lam reaches 0 after this training fraction (SpecForge); 0 = none

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.gru_hidden_dim < 1:
            raise ValueError(f"gru_hidden_dim: got {self.gru_hidden_dim}, expected >= 1")
        if self.emb_dim < 1:
            raise ValueError(f"emb_dim: got {self.emb_dim}, expected >= 1")
        if not 0.0 <= self.lambda_start <= 1.0:
            raise ValueError(f"lambda_start: got {self.lambda_start}, expected in [0, 1]")
        if not 0.0 <= self.lambda_decay_fraction <= 1.0:
            raise ValueError(f"lambda_decay_fraction: got {self.lambda_decay_fraction}, expected in [0, 1] "
                             "(the fraction of training over which the base-logit weight decays to 0)")


def curriculum_lambda(cfg: DominoConfig, progress: float) -> float:
    """The base-anchored curriculum: lambda_start * max(0, 1 - progress / fraction) (0 when fraction is 0),
    progress in [0, 1] (step / total steps)."""
    if not 0.0 <= progress <= 1.0:
        raise ValueError(f"progress: got {progress}, expected in [0, 1]")
    if cfg.lambda_decay_fraction == 0.0:
        return 0.0
    return cfg.lambda_start * max(0.0, 1.0 - progress / cfg.lambda_decay_fraction)
