"""Pad feature-store samples into a right-padded batch: per-token fields [B, T, ...] (padding
`PAD_VALUES[name]` or 0, so padded rows carry no loss), scalars [B], attention_mask bool [B, T] and
lengths int64 [B]; `check_batch` is every objective's first check of such a batch."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

PAD_VALUES: dict[str, int] = {"input_ids": 0, "loss_mask": 0}
RESERVED = ("attention_mask", "lengths")


def collate(samples: Sequence[Mapping[str, Tensor]], pad_to_multiple_of: int = 1,
            length_field: str = "input_ids") -> dict[str, Tensor]:
    if not samples:
        raise ValueError("collate: got an empty list of samples")
    keys = list(samples[0])
    if length_field not in keys:
        raise ValueError(f"collate: samples have no {length_field!r} field (fields: {keys})")
    for i, s in enumerate(samples):
        if set(s) != set(keys):
            raise ValueError(f"collate: sample {i} has fields {sorted(s)}, sample 0 has {sorted(keys)}")
        for r in RESERVED:
            if r in s:
                raise ValueError(f"collate: sample {i} already has the reserved field {r!r}")
    lengths = torch.tensor([int(s[length_field].shape[0]) for s in samples], dtype=torch.int64)
    max_len = int(lengths.max())
    max_len = -(-max_len // pad_to_multiple_of) * pad_to_multiple_of
    batch: dict[str, Tensor] = {}
    for key in keys:
        first = samples[0][key]
        if first.dim() == 0:
            batch[key] = torch.stack([s[key] for s in samples])
            continue
        out = first.new_full((len(samples), max_len, *first.shape[1:]), PAD_VALUES.get(key, 0))
        for i, s in enumerate(samples):
            t = s[key]
            if t.shape[0] != lengths[i] or t.shape[1:] != first.shape[1:] or t.dtype != first.dtype:
                raise ValueError(f"collate: sample {i} field {key!r} is {tuple(t.shape)} {t.dtype}, expected "
                                 f"({int(lengths[i])}, {', '.join(map(str, first.shape[1:]))}) {first.dtype}")
            out[i, : t.shape[0]] = t
        batch[key] = out
    batch["attention_mask"] = torch.arange(max_len)[None, :] < lengths[:, None]
    batch["lengths"] = lengths
    return batch


def check_batch(batch: Mapping[str, Tensor], required: Sequence[str], label: str, exact: Sequence[str] = ()) -> None:
    """A collated batch for an objective: every `required` field and attention_mask present, input_ids,
    loss_mask, attention_mask and the `exact` fields [B, T], other fields [B, T, ...] (features)."""
    missing = [k for k in (*required, "attention_mask") if k not in batch]
    if missing:
        raise KeyError(f"{label} batch: missing fields {missing} (has {sorted(batch)})")
    b, t = batch["input_ids"].shape
    tokens = ("input_ids", "loss_mask", "attention_mask", *exact)
    for key in ("loss_mask", "attention_mask", *(k for k in exact if k in batch)):
        if tuple(batch[key].shape) != (b, t):
            raise ValueError(f"{label} batch: {key} is {tuple(batch[key].shape)}, expected {(b, t)}")
    for key in required:
        if key not in tokens and (batch[key].dim() < 3 or tuple(batch[key].shape[:2]) != (b, t)):
            raise ValueError(f"{label} batch: {key} is {tuple(batch[key].shape)}, expected ({b}, {t}, ...)")
