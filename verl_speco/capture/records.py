"""Tokenized chats + captured hidden states -> Feature Store records (docs/internals.md fields).

Per sample of length ``T`` (padding removed):

- ``input_ids``   int64 ``[T]``
- ``loss_mask``   uint8 ``[T]``, 1 on assistant response tokens
- ``aux_hidden``  ``[T, k*H]`` hidden states at ``layer_ids`` (internal = HF ``hidden_states``
  indexing), concatenated in that order along the last axis
- ``last_hidden`` ``[T, H]`` post-final-norm last hidden state (optional)
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from feature_store import Layout, Schema, standard_schema
from verl_speco.capture.chat import TokenizedChat
from verl_speco.capture.hooks import CapturedFeatures


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"`` (the Feature Store's dtype strings)."""
    return str(dtype).removeprefix("torch.")


def capture_layout(layer_ids: Sequence[int], last_hidden: bool = True) -> Layout:
    """The layout hook capture produces: internal (HF ``hidden_states``) ids, post-norm last hidden."""
    return Layout(layer_ids=tuple(int(i) for i in layer_ids), convention="hf_hidden_states",
                  last_hidden="post_norm" if last_hidden else "none")


def build_schema(layout: Layout, hidden_size: int, vocab_size: int, target_model_id: str,
                 dtype: torch.dtype = torch.bfloat16) -> Schema:
    """The Feature Store schema for captured features: the standard fields (``last_hidden`` unless the
    layout says ``"none"``) with hidden states in ``dtype``."""
    if layout.convention != "hf_hidden_states" or layout.last_hidden not in ("post_norm", "none"):
        raise ValueError(f"layout {layout.to_dict()}: capture produces convention 'hf_hidden_states' and a "
                         f"'post_norm' (or no) last hidden")
    return standard_schema(layout, hidden_size=hidden_size, vocab_size=vocab_size,
                           target_model_id=target_model_id, hidden_dtype=dtype_name(dtype))


def resolve_layout(layer_ids: Sequence[int] | None, algorithm: str | None, hf_config: dict[str, Any],
                   last_hidden: bool | None = None) -> tuple[Layout, tuple[str, ...]]:
    """The layout to capture + the fields the algorithm needs.

    Explicit ``layer_ids`` (internal ids) win; otherwise the drafter family's own
    ``required_layout(default config, target)`` (e.g. eagle3: (2, L//2, L-3), post-norm last hidden).
    """
    from drafters.common.target import TargetSpec

    spec = TargetSpec.from_hf_config(hf_config)
    if layer_ids:
        layout = capture_layout(layer_ids, True if last_hidden is None else last_hidden)
        required: tuple[str, ...] = ()
    elif algorithm:
        from drafters.registry import get_family

        try:
            family = get_family(algorithm)
        except LookupError as e:            # unknown or not implemented: the message lists the valid ones
            raise ValueError(f"algorithm: {e}") from e
        cfg = family.config_cls()
        layout, required = family.required_layout(cfg, spec), tuple(family.required_fields(cfg))
        if last_hidden is not None and last_hidden != (layout.last_hidden != "none"):
            raise ValueError(f"last_hidden={last_hidden}: algorithm {algorithm!r} needs layout {layout.to_dict()}")
    else:
        raise ValueError("layer_ids: none given and no algorithm; pass --layers (internal HF hidden_states ids, "
                         "e.g. 2,4,5) or --algorithm (e.g. eagle3)")
    bad = [i for i in layout.layer_ids if not 0 <= i <= spec.num_hidden_layers]
    if not layout.layer_ids or bad:
        raise ValueError(f"layer_ids={list(layout.layer_ids)}: expected a non-empty list in "
                         f"[0, {spec.num_hidden_layers}] (HF hidden_states indexing for a "
                         f"{spec.num_hidden_layers}-layer target)")
    return layout, required


@dataclass
class LengthFilter:
    """Explicit length policy; every sample it changes or drops is counted (never silent).

    - ``max_length``: sequences longer than this are cut to it (``truncated`` counts them);
    - ``min_response_tokens``: samples with fewer response tokens (after the cut) are dropped
      (``dropped_short`` counts them). The default 1 drops only samples with no response at all,
      which carry no training signal.
    """

    min_response_tokens: int = 1
    max_length: int | None = None
    kept: int = 0
    truncated: int = 0
    dropped_short: int = 0
    dropped_examples: list[int] = field(default_factory=list)   # first few dropped indices

    def __post_init__(self) -> None:
        if self.min_response_tokens < 1:
            raise ValueError(f"min_response_tokens={self.min_response_tokens}: expected >= 1 (a sample "
                             f"with an empty loss mask has no training signal; the Feature Store rejects it)")
        if self.max_length is not None and self.max_length < 1:
            raise ValueError(f"max_length={self.max_length}: expected >= 1 or None")

    def apply(self, chat: TokenizedChat, index: int = -1) -> TokenizedChat | None:
        if self.max_length is not None and len(chat.input_ids) > self.max_length:
            chat = TokenizedChat(chat.input_ids[: self.max_length], chat.loss_mask[: self.max_length])
            self.truncated += 1
        if chat.num_response_tokens < self.min_response_tokens:
            self.dropped_short += 1
            if len(self.dropped_examples) < 10:
                self.dropped_examples.append(index)
            return None
        self.kept += 1
        return chat

    def summary(self) -> dict[str, int]:
        return {"kept": self.kept, "truncated": self.truncated, "dropped_short": self.dropped_short}


def pad_batch(chats: Sequence[TokenizedChat], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad to the longest: ``input_ids [B, T]`` (pad_id), ``attention_mask [B, T]`` (1 = real)."""
    longest = max(len(c.input_ids) for c in chats)
    ids = torch.full((len(chats), longest), pad_id, dtype=torch.long)
    mask = torch.zeros((len(chats), longest), dtype=torch.long)
    for b, chat in enumerate(chats):
        n = len(chat.input_ids)
        ids[b, :n] = chat.input_ids
        mask[b, :n] = 1
    return ids, mask


def batch_records(chats: Sequence[TokenizedChat], feats: CapturedFeatures) -> list[dict[str, torch.Tensor]]:
    """Split a right-padded batch's features ``[B, T_pad, ...]`` into per-sample records ``[T, ...]``."""
    aux = feats.aux_hidden                                   # [B, T_pad, k*H]
    if aux.dim() != 3 or aux.shape[0] != len(chats):
        raise ValueError(f"batch_records: aux_hidden shape {tuple(aux.shape)}, expected "
                         f"[{len(chats)}, T_pad, k*H] (one row per chat)")
    records = []
    for b, chat in enumerate(chats):
        n = len(chat.input_ids)
        record = {"input_ids": chat.input_ids.to(torch.int64), "loss_mask": chat.loss_mask.to(torch.uint8),
                  "aux_hidden": aux[b, :n].contiguous()}
        if feats.last_hidden is not None:
            record["last_hidden"] = feats.last_hidden[b, :n].contiguous()   # [T, H]
        records.append(record)
    return records
