"""EAGLE-3 drafter configuration (docs/design/algorithms.md section 3): the draft's sizes are the
target's; `resolve(target_spec)` fills the target-dependent defaults and checks them against it."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Self

from drafters.common.attention import BACKENDS
from drafters.common.chunked_head import DEFAULT_LOSS_CHUNK_ROWS, check_chunk_rows
from drafters.common.layer_ids import check_servable_aux_ids, default_eagle3_layer_ids
from drafters.common.target import TargetSpec

LM_HEAD_INITS = ("random", "target")


@dataclass(frozen=True)
class Eagle3Architecture:
    """The EAGLE-3 draft architecture, shared by EAGLE-3 and P-EAGLE (drafters/peagle)."""

    draft_vocab_size: int | None = None  # Vd; None = the target vocab (identity maps, not exported)
    num_layers: int = 1  # layer 0 is the fused 2H "midlayer", later ones plain (vLLM)
    aux_layer_ids: tuple[int, ...] | None = None  # internal ids, increasing in 1..L-1; None = (2, L // 2, L - 3)
    attn_backend: str = "auto"  # "auto" (flex on CUDA, else SDPA), "sdpa" or "flex"
    norm_before_residual: bool = False  # vLLM option: the residual is hidden_norm(h) instead of h
    lm_head_init: str = "random"  # "random" (SafeAILab) or "target" (the target head's draft-vocab rows)
    loss_chunk_rows: int = DEFAULT_LOSS_CHUNK_ROWS  # rows of logits alive at once (common/chunked_head.py)

    def __post_init__(self) -> None:
        check_chunk_rows(self.loss_chunk_rows)
        if self.num_layers < 1:
            raise ValueError(f"num_layers: got {self.num_layers}, expected >= 1")
        if self.attn_backend not in BACKENDS:
            raise ValueError(f"attn_backend: got {self.attn_backend!r}, expected one of {BACKENDS}")
        if self.lm_head_init not in LM_HEAD_INITS:
            raise ValueError(f"lm_head_init: got {self.lm_head_init!r}, expected one of {LM_HEAD_INITS}")
        if self.aux_layer_ids is not None:
            object.__setattr__(self, "aux_layer_ids", tuple(int(i) for i in self.aux_layer_ids))
            if not self.aux_layer_ids:
                raise ValueError("aux_layer_ids: got an empty tuple, expected >= 1 layer id (or None)")

    def resolve(self, target_spec: TargetSpec) -> Self:
        """Fill `aux_layer_ids` / `draft_vocab_size` from the target and check them against it."""
        num_layers, vocab = target_spec.num_hidden_layers, target_spec.vocab_size
        aux = self.aux_layer_ids if self.aux_layer_ids is not None else default_eagle3_layer_ids(num_layers)
        aux = check_servable_aux_ids(aux, num_layers)
        vd = vocab if self.draft_vocab_size is None else self.draft_vocab_size
        if not 0 < vd <= vocab:
            raise ValueError(f"draft_vocab_size: got {vd}, expected 1..{vocab} (target vocab_size)")
        return replace(self, aux_layer_ids=tuple(aux), draft_vocab_size=vd)


@dataclass(frozen=True)
class Eagle3Config(Eagle3Architecture):
    """`Eagle3Architecture` plus the training-time test."""

    ttt_steps: int = 7  # unroll length (7 as in the paper, SpecForge, DeepSpec)
    ttt_decay: float = 0.8  # step j's loss weight is ttt_decay ** j

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.ttt_steps < 1:
            raise ValueError(f"ttt_steps: got {self.ttt_steps}, expected >= 1")
        if not 0 < self.ttt_decay <= 1:
            raise ValueError(f"ttt_decay: got {self.ttt_decay}, expected in (0, 1]")
