"""verl actor batches -> the `[B, T]` rows `verl_speco.online.capture` works on (torch only): full-sequence
masks from jagged or padded batches, rows planned for the whole batch, each micro-batch (reordered, packed
or padded) keeping only its planned rows' activations, `assemble` restoring batch order."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from verl_speco.capture.hooks import CapturedFeatures


def _offsets(nested: Any) -> Tensor:
    offsets: Tensor = nested.offsets().cpu()
    return offsets


ROW_ID_KEY = "speco_row_id"  # per-sample batch index added to the batch so micro-batches name their rows


def _lengths(nested: Any) -> Tensor:
    lengths: Tensor = nested.offsets().diff().cpu()
    return lengths


def full_sequence_masks(input_ids: Tensor, loss_mask: Tensor,
                        attention_mask: Tensor | None = None) -> tuple[Tensor, Tensor, Tensor]:
    """(input_ids [B, T] right-padded, attention_mask [B, T], loss_mask [B, T]) on the CPU."""
    if input_ids.is_nested:
        lengths = _lengths(input_ids)
        ids = torch.nested.to_padded_tensor(input_ids, 0).cpu()
        width = ids.shape[1]
        am = (torch.arange(width)[None, :] < lengths[:, None]).to(torch.int64)
        lm = torch.zeros_like(ids)
        if loss_mask.is_nested:
            lm_len = _lengths(loss_mask)
            values = loss_mask.values().cpu()
            starts = _offsets(loss_mask)
            for b in range(ids.shape[0]):
                n, r = int(lengths[b]), int(lm_len[b])
                if r > n:
                    raise ValueError(f"loss_mask row {b}: {r} tokens but the sequence has {n}; expected the "
                                     "response mask to cover a suffix of input_ids")
                lm[b, n - r:n] = values[int(starts[b]):int(starts[b]) + r].to(lm.dtype)
        elif tuple(loss_mask.shape) == tuple(ids.shape):
            lm = loss_mask.cpu().to(lm.dtype)
        else:
            raise ValueError(f"loss_mask {tuple(loss_mask.shape)} with nested input_ids: expected a nested "
                             f"mask or a padded one of shape {tuple(ids.shape)}")
        return ids, am, lm
    if attention_mask is None:
        raise ValueError("padded input_ids need an attention_mask (verl's legacy batch layout)")
    ids, am = input_ids.cpu(), attention_mask.cpu().to(torch.int64)
    if tuple(loss_mask.shape) == tuple(ids.shape):
        lm = loss_mask.cpu().to(torch.int64)
    elif loss_mask.dim() == 2 and loss_mask.shape[0] == ids.shape[0] and loss_mask.shape[1] <= ids.shape[1]:
        lm = torch.zeros_like(ids)
        lm[:, ids.shape[1] - loss_mask.shape[1]:] = loss_mask.cpu().to(lm.dtype)
    else:
        raise ValueError(f"loss_mask {tuple(loss_mask.shape)}: expected [B, T] = {tuple(ids.shape)} or a "
                         "[B, R] response mask over the last R columns")
    return ids, am, lm


@dataclass
class MicroBatchSelection:
    """The planned rows of one micro-batch: their position in it and their valid token counts."""

    row_ids: list[int]  # batch rows, in the order their tokens are taken
    positions: list[int]  # row position inside the micro-batch
    lengths: list[int]  # valid tokens of the row (the whole row: truncation happens later)
    starts: list[int]  # packed layout: start of the row in the micro-batch's [1, nnz]
    packed: bool  # remove-padding forward ([1, nnz, ...]) rather than padded ([b, T, ...])
    _index: dict[tuple[int, ...], Tensor] = field(default_factory=dict, repr=False)

    @classmethod
    def build(cls, mb_row_ids: Tensor, mb_lengths: Tensor, keep: set[int], packed: bool) -> MicroBatchSelection:
        ids = [int(i) for i in mb_row_ids.tolist()]
        lengths = [int(n) for n in mb_lengths.tolist()]
        starts, acc = [], 0
        for n in lengths:
            starts.append(acc)
            acc += n
        pos = [p for p, r in enumerate(ids) if r in keep]
        return cls([ids[p] for p in pos], pos, [lengths[p] for p in pos], [starts[p] for p in pos], packed)

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)

    def __call__(self, t: Tensor) -> Tensor:
        """Activations of the planned rows, packed `[1, n, ...]`, from `[1, nnz(+pad), ...]` or `[b, T, ...]`."""
        packed = self.packed
        if packed and t.shape[0] != 1:
            raise ValueError(f"remove-padding capture: activations {tuple(t.shape)}, expected [1, nnz, ...]")
        key = (int(packed), int(t.shape[1]))
        if key not in self._index:
            if packed:
                parts = [torch.arange(s, s + n) for s, n in zip(self.starts, self.lengths)]
            else:
                width = int(t.shape[1])
                parts = [torch.arange(n) + p * width for p, n in zip(self.positions, self.lengths)]
            self._index[key] = torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)
        index = self._index[key].to(t.device)
        if packed:
            return t[0].index_select(0, index).unsqueeze(0)
        return t.reshape(-1, *t.shape[2:]).index_select(0, index).unsqueeze(0)


def assemble(parts: list[tuple[MicroBatchSelection, CapturedFeatures]]) -> tuple[list[int], CapturedFeatures]:
    """Kept rows of all micro-batches in ascending batch order, packed `[1, n, ...]`."""
    if not parts:
        raise ValueError("assemble: no micro-batch was captured")
    spans: list[tuple[int, int, int]] = []  # (row id, start in the concatenation, length)
    offset = 0
    for sel, _ in parts:
        for row, n in zip(sel.row_ids, sel.lengths):
            spans.append((row, offset, n))
            offset += n
    spans.sort()
    order = torch.cat([torch.arange(s, s + n) for _, s, n in spans]) if spans else torch.zeros(0, dtype=torch.long)
    layer_ids = parts[0][1].layer_ids

    def gather(tensors: list[Tensor]) -> Tensor:
        cat = torch.cat(tensors, dim=1)
        return cat.index_select(1, order.to(cat.device))

    hidden = {i: gather([f.hidden[i] for _, f in parts]) for i in layer_ids}
    lasts = [f.last_hidden for _, f in parts]
    last = gather([t for t in lasts if t is not None]) if all(t is not None for t in lasts) else None
    return [row for row, _, _ in spans], CapturedFeatures(layer_ids, hidden, last)
