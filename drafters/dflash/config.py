"""DFlash drafter configuration (docs/design/algorithms.md section 4; docs/design/engines.md sections 2.4 and 4.5).

`target_layer_ids` are the engines' "output of layer i" ids; `hidden_state_ids` converts them to internal
HF `hidden_states` indices (+1, drafters.common.layer_ids). `resolve(target_spec)` fills and checks the rest."""

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
    """The DFlash draft's choices; its sizes are the target's."""

    num_layers: int = 5  # draft decoder layers
    block_size: int = 16  # B rows: [anchor, MASK x (B - 1)], B - 1 drafts per block
    target_layer_ids: tuple[int, ...] | None = None  # output-of-layer ids in 0..L-2; None = z-lab's default
    num_target_features: int = 5  # m target layers feed `fc` (m * H -> H)
    mask_token_id: int | None = None  # None = the target tokenizer's mask token (Qwen3: 151669)
    loss_gamma: float = 7.0  # slot k >= 1 weighs exp(-(k - 1) / gamma)
    num_anchors: int = 512  # blocks sampled per sequence per step
    attn_backend: str = "auto"  # "auto" (flex on CUDA, else SDPA), "sdpa" or "flex"
    loss_chunk_rows: int = DEFAULT_LOSS_CHUNK_ROWS  # rows of logits alive at once (common/chunked_head.py)

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

