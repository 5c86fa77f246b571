"""verl batch layouts -> [B, T] masks, and micro-batch token selection (torch only)."""

from __future__ import annotations

import pytest
import torch

from verl_speco.capture.hooks import CapturedFeatures
from verl_speco.verl_integration.batch_rows import MicroBatchSelection, assemble, full_sequence_masks


def _nested(rows: list[list[int]]) -> torch.Tensor:
    return torch.nested.as_nested_tensor([torch.tensor(r) for r in rows], layout=torch.jagged)


def test_nested_batch_with_response_suffix_masks() -> None:
    ids, am, lm = full_sequence_masks(_nested([[5, 6, 7, 8], [9, 10]]), _nested([[1, 0, 1], [1]]))
    assert ids.tolist() == [[5, 6, 7, 8], [9, 10, 0, 0]]
    assert am.tolist() == [[1, 1, 1, 1], [1, 1, 0, 0]]
    assert lm.tolist() == [[0, 1, 0, 1], [0, 1, 0, 0]]
    with pytest.raises(ValueError, match="loss_mask row 1: 3 tokens but the sequence has 2"):
        full_sequence_masks(_nested([[5, 6, 7, 8], [9, 10]]), _nested([[1], [1, 1, 1]]))


def test_legacy_padded_batch_masks() -> None:
    ids = torch.tensor([[0, 3, 4, 5, 0], [6, 7, 8, 9, 2]])  # left-padded prompt | right-padded response
    am = torch.tensor([[0, 1, 1, 1, 0], [1, 1, 1, 1, 1]])
    response_mask = torch.tensor([[1, 0], [1, 1]])  # over the last 2 columns
    _, am_out, lm = full_sequence_masks(ids, response_mask, am)
    assert am_out.tolist() == am.tolist() and lm.tolist() == [[0, 0, 0, 1, 0], [0, 0, 0, 1, 1]]
    with pytest.raises(ValueError, match="need an attention_mask"):
        full_sequence_masks(ids, response_mask)


@pytest.mark.parametrize("packed", [True, False])
def test_selection_keeps_only_planned_rows_and_assembly_restores_batch_order(packed: bool) -> None:
    # micro-batch 0 holds batch rows [3, 0] (lengths 2, 3); micro-batch 1 holds rows [1, 2] (1, 2)
    def feats(rows: list[int], lengths: list[int]) -> torch.Tensor:
        if packed:
            values = [10.0 * r + t for r, n in zip(rows, lengths) for t in range(n)]
            return torch.tensor(values).reshape(1, -1, 1)
        width = max(lengths)
        out = torch.full((len(rows), width, 1), -1.0)
        for p, (r, n) in enumerate(zip(rows, lengths)):
            out[p, :n, 0] = torch.tensor([10.0 * r + t for t in range(n)])
        return out

    keep = {0, 2, 3}
    parts = []
    for rows, lengths in (([3, 0], [2, 3]), ([1, 2], [1, 2])):
        sel = MicroBatchSelection.build(torch.tensor(rows), torch.tensor(lengths), keep, packed)
        cut = sel(feats(rows, lengths))
        parts.append((sel, CapturedFeatures((1,), {1: cut}, cut)))
    order, merged = assemble(parts)
    assert order == [0, 2, 3]
    assert merged.hidden[1].flatten().tolist() == [0, 1, 2, 20, 21, 30, 31]
