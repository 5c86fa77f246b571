"""TTT attention mask and shifts, pinned by hand-written 0/1 matrices."""

from __future__ import annotations

import pytest
import torch

from drafters.common.masks import shift_left, ttt_attention_mask, ttt_position_ids


def _m(rows: list[str]) -> torch.Tensor:
    return torch.tensor([[c == "1" for c in r.replace(" ", "")] for r in rows])


def test_ttt_mask_t4_steps_0_to_2_by_hand() -> None:
    valid = torch.ones(1, 4, dtype=torch.bool)
    expected = {
        0: ["1000", "1100", "1110", "1111"],
        1: ["1000 1000", "1100 0100", "1110 0010", "1111 0001"],
        2: ["1000 1000 1000", "1100 0100 0100", "1110 0010 0010", "1111 0001 0001"],
    }
    for step, rows in expected.items():
        dense = ttt_attention_mask(valid, step).dense()
        assert dense.shape == (1, 1, 4, 4 * (step + 1))
        assert torch.equal(dense[0, 0], _m(rows)), step


def test_ttt_mask_padding_hides_step0_keys_keeps_diagonal() -> None:
    valid = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]], dtype=torch.bool)  # lengths 4 and 2
    dense = ttt_attention_mask(valid, 2).dense()
    assert torch.equal(dense[0, 0], _m(["1000 1000 1000", "1100 0100 0100", "1110 0010 0010", "1111 0001 0001"]))
    assert torch.equal(dense[1, 0], _m(["1000 1000 1000", "1100 0100 0100", "1110 0010 0010", "1101 0001 0001"]))
    assert bool(dense.any(-1).all())  # no empty row -> no NaN in softmax


def test_positions_and_shift_left() -> None:
    pos = torch.tensor([[0, 1, 2, 3]])
    assert ttt_position_ids(pos, 3).tolist() == [[3, 4, 5, 6]]
    x = torch.tensor([[10, 11, 12, 13], [20, 21, 22, 23]])
    assert shift_left(x, 0).tolist() == x.tolist()
    assert shift_left(x, 1).tolist() == [[11, 12, 13, 0], [21, 22, 23, 0]]
    assert shift_left(x, 3, fill=-1).tolist() == [[13, -1, -1, -1], [23, -1, -1, -1]]
    assert shift_left(x, 9).tolist() == [[0] * 4, [0] * 4]
    h = torch.arange(8.0).view(1, 4, 2)  # trailing dims move with their row
    assert shift_left(h, 2).tolist() == [[[4.0, 5.0], [6.0, 7.0], [0.0, 0.0], [0.0, 0.0]]]
    with pytest.raises(ValueError, match="n: got -1"):
        shift_left(x, -1)
