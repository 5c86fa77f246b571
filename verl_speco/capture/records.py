"""Tokenized chats + captured hidden states -> Feature Store records (docs/internals.md fields).

Per sample of length ``T`` (padding removed):

- ``input_ids``   int64 ``[T]``
- ``loss_mask``   uint8 ``[T]``, 1 on assistant response tokens
- ``aux_hidden``  ``[T, k*H]`` hidden states at ``layer_ids`` (internal = HF ``hidden_states``
  indexing), concatenated in that order along the last axis (absent when there are no layer ids)
- ``last_hidden`` ``[T, H]`` post-final-norm last hidden state (optional)"""

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
                 dtype: torch.dtype = torch.bfloat16, encoding: str = "raw") -> Schema:
    """The Feature Store schema for captured features: the standard fields (``last_hidden`` unless the
    layout says ``"none"``) with hidden states in ``dtype``, stored as ``encoding`` ("raw" or "fp8_e4m3")."""
    if layout.convention != "hf_hidden_states" or layout.last_hidden not in ("post_norm", "none"):
        raise ValueError(f"layout {layout.to_dict()}: capture produces convention 'hf_hidden_states' and a "
                         f"'post_norm' (or no) last hidden")
    return standard_schema(layout, hidden_size=hidden_size, vocab_size=vocab_size,
                           target_model_id=target_model_id, hidden_dtype=dtype_name(dtype),
                           hidden_encoding=encoding)


def family_names(families: str | Sequence[str] | None) -> tuple[str, ...]:
    """``"eagle1,eagle3"`` or ``["eagle1", "eagle3"]`` -> ``("eagle1", "eagle3")`` (order kept, repeats dropped)."""
    if families is None:
        return ()
    names = families.split(",") if isinstance(families, str) else list(families)
    return tuple(dict.fromkeys(n.strip() for n in names if n.strip()))


def load_families(families: str | Sequence[str] | None) -> list[Any]:
    """The drafter family objects named by ``families`` (``family_names``); an unknown or not yet
    implemented name fails listing the valid / implemented ones."""
    from drafters.registry import get_family

    out = []
    for name in family_names(families):
        try:
            out.append(get_family(name))
        except LookupError as e:            # unknown or not implemented: the message lists the valid ones
            raise ValueError(f"--layout-of {name!r}: {e}") from e
    return out


def union_layout(layouts: Sequence[tuple[str, Layout]]) -> Layout:
    """The layout serving every ``(family name, layout)``: the union of their layer ids (increasing)
    and a post-norm last hidden when any of them reads one. Capture produces HF ``hidden_states``
    ids and a post-norm (or no) last hidden; any other request fails naming the family."""
    for name, lay in layouts:
        if lay.convention != "hf_hidden_states" or lay.last_hidden not in ("post_norm", "none"):
            raise ValueError(f"--layout-of {name!r}: the family needs layout {lay.to_dict()}; capture produces "
                             f"convention 'hf_hidden_states' and a 'post_norm' (or no) last hidden")
    ids = sorted({i for _, lay in layouts for i in lay.layer_ids})
    last = "post_norm" if any(lay.last_hidden == "post_norm" for _, lay in layouts) else "none"
    return Layout(layer_ids=tuple(ids), convention="hf_hidden_states", last_hidden=last)


def resolve_layout(layer_ids: Sequence[int] | None, families: str | Sequence[str] | None,
                   hf_config: dict[str, Any], last_hidden: bool | None = None) -> tuple[Layout, tuple[str, ...]]:
    """The layout to capture + the fields the named families need.

    Explicit ``layer_ids`` (internal ids) win; otherwise the union (``union_layout``) of each drafter
    family's own ``required_layout(default config, target)`` (e.g. eagle3: (2, L//2, L-3) with a
    post-norm last hidden; eagle1: no layer, the post-norm last hidden). ``families`` names one
    family or several (``"eagle1,eagle3"``); one store then serves each of them."""
    from drafters.common.target import TargetSpec

    spec = TargetSpec.from_hf_config(hf_config)
    names = family_names(families)
    if layer_ids:
        layout = capture_layout(layer_ids, True if last_hidden is None else last_hidden)
        required: tuple[str, ...] = ()
    elif names:
        layouts, fields = [], []
        for name, family in zip(names, load_families(names)):
            cfg = family.config_cls()
            layouts.append((name, family.required_layout(cfg, spec)))
            fields += family.required_fields(cfg)
        layout, required = union_layout(layouts), tuple(dict.fromkeys(fields))
        if last_hidden is not None and last_hidden != (layout.last_hidden != "none"):
            raise ValueError(f"last_hidden={last_hidden}: --layout-of {','.join(names)} needs layout "
                             f"{layout.to_dict()}")
    else:
        raise ValueError("layer_ids: none given and no drafter family; pass --layer-ids/--layers (internal HF "
                         "hidden_states ids, e.g. 2,4,5) or --layout-of/--family (e.g. eagle3 or eagle1,eagle3)")
    bad = [i for i in layout.layer_ids if not 0 <= i <= spec.num_hidden_layers]
    if bad or not (layout.layer_ids or layout.last_hidden != "none"):
        raise ValueError(f"layer_ids={list(layout.layer_ids)}: expected ids in [0, {spec.num_hidden_layers}] "
                         f"(HF hidden_states indexing for a {spec.num_hidden_layers}-layer target), at least "
                         f"one unless the last hidden state is stored")
    return layout, required


@dataclass
class LengthFilter:
    """Explicit length policy; every sample it changes or drops is counted (never silent).

    - ``max_length``: sequences longer than this are cut to it (``truncated`` counts them);
    - ``min_response_tokens``: samples with fewer response tokens (after the cut) are dropped
      (``dropped_short`` counts them). The default 1 drops only samples with no response at all,
      which carry no training signal."""

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
    aux = feats.aux_hidden if feats.layer_ids else None    # [B, T_pad, k*H]; none without layer ids
    for name, t in (("aux_hidden", aux), ("last_hidden", feats.last_hidden)):
        if t is not None and (t.dim() != 3 or t.shape[0] != len(chats)):
            raise ValueError(f"batch_records: {name} shape {tuple(t.shape)}, expected "
                             f"[{len(chats)}, T_pad, *] (one row per chat)")
    records = []
    for b, chat in enumerate(chats):
        n = len(chat.input_ids)
        record = {"input_ids": chat.input_ids.to(torch.int64), "loss_mask": chat.loss_mask.to(torch.uint8)}
        if aux is not None:
            record["aux_hidden"] = aux[b, :n].contiguous()
        if feats.last_hidden is not None:
            record["last_hidden"] = feats.last_hidden[b, :n].contiguous()   # [T, H]
        records.append(record)
    return records
