"""DFlash drafter configuration (docs/design/algorithms.md section 4; docs/design/engines.md sections 2.4 and 4.5).

The draft's sizes (hidden, heads, kv heads, head_dim, intermediate, rope_theta, eps) are the
target's; only the fields below are choices. `resolve(target_spec)` fills the defaults that
depend on the target and validates everything against it.

Layer ids: `target_layer_ids` uses the engines' DFlash convention, "output of layer i" (what
`dflash_config.target_layer_ids` holds in vLLM and SGLang); `hidden_state_ids` converts them to
the internal HF `hidden_states` index (+1) through drafters.common.layer_ids.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Self

from drafters.common.attention import BACKENDS
from drafters.common.chunked_head import DEFAULT_LOSS_CHUNK_ROWS, check_chunk_rows
from drafters.common.layer_ids import (
    check_servable_aux_ids,
    default_dflash_layer_ids,
    from_engine_layer_ids,
    to_engine_layer_ids,
)
from drafters.common.target import TargetSpec

LAYER_ID_KEY = "vllm.dflash_config.target_layer_ids"  # output-of-layer ids (engine integer = internal - 1)


@dataclass(frozen=True)
class DFlashConfig:
    """
    num_layers: draft decoder layers (Qwen3-8B recipe: 5).
    block_size: B, rows per block: [anchor, MASK x (B - 1)]; B - 1 drafts per block.
    target_layer_ids: output-of-layer ids of the m context layers, strictly increasing within
        0..L-2; None = z-lab's default [1 + round(i * (L - 4) / (m - 1))] ([1, 9, 17, 25, 33] for
        L = 36, m = 5).
    num_target_features: m, how many target layers feed `fc` (m * H -> H).
    mask_token_id: the MASK token id (Qwen3: 151669); None = the target tokenizer's mask token
        (`TargetSpec.mask_token_id`); checked against the target vocab.
    loss_gamma: slot k >= 1 has loss weight exp(-(k - 1) / gamma) (7 for B = 16).
    num_anchors: blocks sampled per sequence per step (512).
    attn_backend: "auto" (flex on CUDA, else SDPA), "sdpa" or "flex".
    loss_chunk_rows: loss rows per chunk of the LM head + loss (drafters/common/chunked_head.py): at
        most this many rows of [rows, vocab] logits are alive at once; the loss does not depend on it.
    """

    num_layers: int = 5
    block_size: int = 16
    target_layer_ids: tuple[int, ...] | None = None
    num_target_features: int = 5
    mask_token_id: int | None = None
    loss_gamma: float = 7.0
    num_anchors: int = 512
    attn_backend: str = "auto"
    loss_chunk_rows: int = DEFAULT_LOSS_CHUNK_ROWS

    def __post_init__(self) -> None:
        check_chunk_rows(self.loss_chunk_rows)
        if self.num_layers < 1:
            raise ValueError(f"num_layers: got {self.num_layers}, expected >= 1")
        if self.block_size < 2:
            raise ValueError(f"block_size: got {self.block_size}, expected >= 2 (anchor + at least one MASK)")
        if self.num_target_features < 1:
            raise ValueError(f"num_target_features: got {self.num_target_features}, expected >= 1")
        if not self.loss_gamma > 0:
            raise ValueError(f"loss_gamma: got {self.loss_gamma}, expected > 0")
        if self.num_anchors < 1:
            raise ValueError(f"num_anchors: got {self.num_anchors}, expected >= 1")
        if self.attn_backend not in BACKENDS:
            raise ValueError(f"attn_backend: got {self.attn_backend!r}, expected one of {BACKENDS}")
        if self.mask_token_id is not None and self.mask_token_id < 0:
            raise ValueError(f"mask_token_id: got {self.mask_token_id}, expected a token id >= 0")
        if self.target_layer_ids is not None:
            ids = tuple(int(i) for i in self.target_layer_ids)
            object.__setattr__(self, "target_layer_ids", ids)
            if len(ids) != self.num_target_features:
                raise ValueError(f"target_layer_ids: got {ids} ({len(ids)} ids), expected "
                                 f"num_target_features={self.num_target_features} ids")

    def resolve(self, target_spec: TargetSpec) -> Self:
        """Fill `target_layer_ids` from the target and check them and `mask_token_id` against it."""
        ids, vocab = self._layer_ids(target_spec), target_spec.vocab_size
        mask = self.mask_token_id if self.mask_token_id is not None else target_spec.mask_token_id
        if mask is None or not 0 <= mask < vocab:
            raise ValueError(f"mask_token_id: got {mask}, expected a token id in 0..{vocab - 1} (target vocab; "
                             "Qwen3 uses 151669); None takes the target tokenizer's mask token, and this target's "
                             "tokenizer has none")
        return replace(self, target_layer_ids=ids, mask_token_id=mask)

    def _layer_ids(self, target_spec: TargetSpec) -> tuple[int, ...]:
        """The output-of-layer context ids (the default when None), checked against the target."""
        num_layers = target_spec.num_hidden_layers
        if self.target_layer_ids is None:
            ids = to_engine_layer_ids(default_dflash_layer_ids(num_layers, self.num_target_features),
                                      LAYER_ID_KEY, num_layers)
        else:
            ids = self.target_layer_ids
        try:
            check_servable_aux_ids(tuple(i + 1 for i in ids), num_layers)
        except ValueError:
            raise ValueError(f"target_layer_ids: got {ids}, expected strictly increasing output-of-layer ids "
                             f"within 0..{num_layers - 2} ({num_layers}-layer target)") from None
        return ids

    def hidden_state_ids(self, target_spec: TargetSpec) -> tuple[int, ...]:
        """Internal (HF hidden_states index) ids of the context layers: target_layer_ids + 1 (the
        store layout; needs no mask token)."""
        return from_engine_layer_ids(self._layer_ids(target_spec), LAYER_ID_KEY, target_spec.num_hidden_layers)

