"""The drift harness's paired comparison, against figures worked by hand."""

from __future__ import annotations

import math

import pytest

from verl_speco.drift import paired_difference


def test_paired_difference_by_hand() -> None:
    # per prompt [num_drafts, num_accepted]: base rates 2/4, 1/2, 3/3; other 3/4, 2/2, 3/3
    base = [[4, 2], [2, 1], [3, 3]]
    other = [[4, 3], [2, 2], [3, 3]]
    # differences 0.25, 0.5, 0.0: mean 0.25, sample sd 0.25, se 0.25 / sqrt(3)
    got = paired_difference(base, other)
    assert got["prompts"] == 3
    assert got["mean_difference"] == pytest.approx(0.25)
    assert got["standard_error"] == pytest.approx(0.25 / math.sqrt(3))
    assert got["t"] == pytest.approx(math.sqrt(3))


def test_paired_difference_is_signed_and_skips_undrafted_prompts() -> None:
    base = [[4, 3], [0, 0], [2, 2], [5, 0]]
    other = [[4, 1], [3, 3], [2, 1], [5, 0]]  # prompt 1: base never drafted -> left out
    got = paired_difference(base, other)
    assert got["prompts"] == 3
    assert got["mean_difference"] == pytest.approx((-0.5 - 0.5 + 0.0) / 3)
    assert got["t"] < 0


def test_paired_difference_refuses_unpaired_input() -> None:
    with pytest.raises(ValueError, match="3 vs 2 prompts"):
        paired_difference([[1, 1]] * 3, [[1, 1]] * 2)
    with pytest.raises(ValueError, match="1 prompt"):
        paired_difference([[1, 1], [0, 0]], [[1, 0], [1, 1]])
