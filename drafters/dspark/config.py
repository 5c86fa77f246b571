"""DSpark drafter configuration (docs/design/algorithms.md section 5; docs/design/engines.md sections 2.5 and 4.7).

The DFlash backbone with every slot drafting (block [x_a, MASK x (B - 1)], slot k predicts x_{a+k+1}, so
vLLM's num_speculative_tokens = B), a Markov head (logits U_k + W2 e, e = W1[x_prev], optionally gated) and
a confidence head; loss weights (ce, l1, conf) = (0.1, 0.9, 1.0), slot k weighs exp(-k / gamma)."""

from __future__ import annotations

from dataclasses import dataclass

from drafters.dflash.config import DFlashConfig

MARKOV_HEAD_TYPES = ("vanilla", "gated")
CE_MODES = ("full", "restricted", "sampled")


@dataclass(frozen=True)
class DSparkConfig(DFlashConfig):
    """DFlashConfig's fields (block_size = gamma drafts per block here) plus the heads and the loss mix."""

    block_size: int = 7
    loss_gamma: float = 4.0
    markov_rank: int = 256  # r of W1 / W2 [V, r] (DeepSpec 256); 0 = no Markov head
    markov_head_type: str = "vanilla"  # "vanilla" (vLLM and SGLang) or "gated" (SGLang only)
    enable_confidence_head: bool = True
    confidence_head_with_markov: bool = True  # the confidence head reads [h ; e], else h alone
    ce_weight: float = 0.1
    l1_weight: float = 0.9
    conf_weight: float = 1.0
    ce_mode: str = "full"  # "full", "restricted" (target's top ce_vocab + label), "sampled" (ce_vocab negatives)
    ce_vocab: int = 0  # candidates of the restricted / sampled CE; the L1 term always uses the full vocab

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
