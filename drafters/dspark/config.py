"""DSpark drafter configuration (docs/design/algorithms.md section 5; docs/design/engines.md sections 2.5 and 4.7).

DSpark is the DFlash backbone (`DFlashConfig`'s fields: layers, context layer ids, MASK id,
anchors, attention backend) with another block layout and two heads:
- block_size B = gamma: the block is [x_a, MASK x (B - 1)] and EVERY slot drafts: slot k
  predicts x_{a+k+1} (the anchor predicts the first new token), so one block gives B drafts and
  vLLM's num_speculative_tokens = B (not B - 1 as for DFlash);
- a Markov head: p_k(v) ~ exp(U_k(v) + bias(x_{a+k})_v), bias = W2 . e, e = W1[x_prev] (vanilla)
  or sigmoid(gate_proj([h_k ; W1[x_prev]])) * W1[x_prev] (gated); W1 [V, r], W2 [V, r];
- a confidence head c_k = sigmoid(proj([h_k ; e_k])) (or proj(h_k) without the Markov input).
Loss weights (ce, l1, conf) = (0.1, 0.9, 1.0); slot k carries exp(-k / gamma) (draft k + 1 has
exp(-((k + 1) - 1) / gamma)), gamma 4 for block 7.
"""

from __future__ import annotations

from dataclasses import dataclass

from drafters.dflash.config import DFlashConfig

MARKOV_HEAD_TYPES = ("vanilla", "gated")
CE_MODES = ("full", "restricted", "sampled")


@dataclass(frozen=True)
class DSparkConfig(DFlashConfig):
    """DFlashConfig's fields (block_size = gamma drafts per block here) plus:

    markov_rank: r of W1 [V, r] / W2 [V, r] (DeepSpec 256); 0 = no Markov head.
    markov_head_type: "vanilla" (servable by vLLM and SGLang) or "gated" (SGLang only).
    enable_confidence_head / confidence_head_with_markov: the confidence head and whether it
        reads [h ; e] (True) or h alone.
    ce_weight, l1_weight, conf_weight: the loss mix (0.1, 0.9, 1.0).
    ce_mode: "full" CE over the vocabulary; "restricted": over the target's top `ce_vocab`
        tokens plus the label; "sampled": the label plus `ce_vocab` uniformly drawn negatives
        (sampled softmax, log-uniform correction). The L1 term always uses the full distributions.
    ce_vocab: the candidate count of the restricted / sampled CE (ignored for "full").
    """

    block_size: int = 7
    loss_gamma: float = 4.0
    markov_rank: int = 256
    markov_head_type: str = "vanilla"
    enable_confidence_head: bool = True
    confidence_head_with_markov: bool = True
    ce_weight: float = 0.1
    l1_weight: float = 0.9
    conf_weight: float = 1.0
    ce_mode: str = "full"
    ce_vocab: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.markov_rank < 0:
            raise ValueError(f"markov_rank: got {self.markov_rank}, expected >= 0 (0 = no Markov head)")
        if self.markov_head_type not in MARKOV_HEAD_TYPES:
            raise ValueError(f"markov_head_type: got {self.markov_head_type!r}, expected one of {MARKOV_HEAD_TYPES}")
        if self.markov_head_type == "gated" and self.markov_rank == 0:
            raise ValueError("markov_head_type: got 'gated' with markov_rank 0, expected a rank >= 1")
        if self.confidence_head_with_markov and self.markov_rank == 0 and self.enable_confidence_head:
            raise ValueError("confidence_head_with_markov: got True with markov_rank 0, expected False "
                             "(there is no Markov feature to read)")
        for name in ("ce_weight", "l1_weight", "conf_weight"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}: got {getattr(self, name)}, expected >= 0")
        if self.ce_mode not in CE_MODES:
            raise ValueError(f"ce_mode: got {self.ce_mode!r}, expected one of {CE_MODES}")
        if self.ce_mode != "full" and self.ce_vocab < 1:
            raise ValueError(f"ce_vocab: got {self.ce_vocab} with ce_mode {self.ce_mode!r}, expected >= 1")
