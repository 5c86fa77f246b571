"""EAGLE-3 drafter configuration (docs/design/algorithms.md section 3).

The draft's sizes (hidden, heads, kv heads, head_dim, intermediate, rope_theta, eps) are the
target's; only the fields below are choices. `resolve(target_spec)` fills the defaults that
depend on the target and validates everything against it.
"""

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
    """The EAGLE-3 draft architecture, shared by EAGLE-3 and P-EAGLE (drafters/peagle).

    draft_vocab_size: Vd; None = the target vocab (identity d2t/t2d, omitted from exports).
    num_layers: decoder layers; layer 0 is the fused 2H layer ("midlayer"), later ones plain (vLLM).
    aux_layer_ids: internal (HF hidden_states index) ids of the fused target layers, strictly
        increasing within 1..L-1; None = (2, L // 2, L - 3) (targets with L >= 7).
    attn_backend: "auto" (flex on CUDA, else SDPA), "sdpa" or "flex".
    norm_before_residual: vLLM option: the residual is hidden_norm(h) instead of h.
    lm_head_init: "random" (SafeAILab) or "target" (rows of the target lm_head at the draft vocab).
    loss_chunk_rows: loss rows per chunk of the LM head + loss (drafters/common/chunked_head.py): at
        most this many rows of [rows, vocab] logits are alive at once; the loss does not depend on it.
    """

    draft_vocab_size: int | None = None
    num_layers: int = 1
    aux_layer_ids: tuple[int, ...] | None = None
    attn_backend: str = "auto"
    norm_before_residual: bool = False
    lm_head_init: str = "random"
    loss_chunk_rows: int = DEFAULT_LOSS_CHUNK_ROWS

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
    """`Eagle3Architecture` plus the training-time test:

    ttt_steps: training-time-test unroll length (7 as in the paper, SpecForge, DeepSpec).
    ttt_decay: step j's loss weight is ttt_decay ** j.
    """

    ttt_steps: int = 7
    ttt_decay: float = 0.8

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.ttt_steps < 1:
            raise ValueError(f"ttt_steps: got {self.ttt_steps}, expected >= 1")
        if not 0 < self.ttt_decay <= 1:
            raise ValueError(f"ttt_decay: got {self.ttt_decay}, expected in (0, 1]")
