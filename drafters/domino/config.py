"""Domino drafter configuration (docs/design/algorithms.md section 6; docs/design/engines.md sections 2.6 and 4.6).

Domino is the DFlash backbone (`DFlashConfig`'s fields) with SGLang's `shift_label` layout and a
correction head:
- the block is [x_a, MASK x (B - 1)] at positions a .. a + B - 1 and slot k (k = 0 .. B - 2)
  predicts x_{a+k+1}: B - 1 drafts per block (SGLang `--speculative-num-draft-tokens` = B);
- base logits U_k = target_lm_head(h_k) from the post-norm backbone hidden h_k;
- `prefix_gru` (1-layer GRU, H -> gru_hidden_dim, no bias) reads the target embeddings of
  x_a, x_{a+1}, ... (teacher-forced in training, the drafts at inference); g_k is its output after
  x_a .. x_{a+k};
- final logits: U_0 at slot 0 (`pure_draft_prefix_len` = 1), U_k + embed_proj([h_k ; g_k]) for
  k >= 1, embed_proj = Linear(H + G -> emb_dim) -> SiLU -> Linear(emb_dim -> V), no biases.
Loss: sum_k w_k [(1 - lam) CE(final_k) + lam CE(U_k)] / sum_k w_k, w_k = exp(-k / gamma) (gamma 7
for block 16), lam = the base-anchored curriculum (`curriculum_lambda`).
"""

from __future__ import annotations

from dataclasses import dataclass

from drafters.dflash.config import DFlashConfig

PURE_DRAFT_PREFIX_LEN = 1  # SGLang requires exactly 1: slot 0 keeps the base logits


@dataclass(frozen=True)
class DominoConfig(DFlashConfig):
    """DFlashConfig's fields (block_size B: B - 1 drafts per block) plus:

    gru_hidden_dim: G, the prefix GRU's state (SpecForge Qwen3-8B: 1024).
    emb_dim: E, embed_proj's inner width (256).
    lambda_start: the curriculum's initial weight of the base-logit CE (1.0: all on the backbone).
    lambda_decay_fraction: lam decays linearly from lambda_start to 0 over this fraction of training
        (SpecForge `lambda_base_decay_ratio`, default 0.5); 0 = no curriculum (lam = 0 throughout).
    """

    gru_hidden_dim: int = 1024
    emb_dim: int = 256
    lambda_start: float = 1.0
    lambda_decay_fraction: float = 0.5

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
    """The base-anchored curriculum: lam(progress) = lambda_start * max(0, 1 - progress / fraction).

    progress in [0, 1] (the trainer's step / total steps). Worked example: lambda_start 1, fraction
    0.5: progress 0 -> 1.0, 0.25 -> 0.5, 0.5 -> 0.0, 0.9 -> 0.0; fraction 0 -> 0.0 throughout.
    """
    if not 0.0 <= progress <= 1.0:
        raise ValueError(f"progress: got {progress}, expected in [0, 1]")
    if cfg.lambda_decay_fraction == 0.0:
        return 0.0
    return cfg.lambda_start * max(0.0, 1.0 - progress / cfg.lambda_decay_fraction)
