"""The drift studies' statistics (verl_speco/drift_stats.py), against figures worked by hand."""

from __future__ import annotations

import math

import pytest

from verl_speco.drift_stats import goal_window, paired_difference


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


def _step(step: int, served: float, initial: float) -> dict[str, float]:
    return {"step": step, "heldout_acceptance": served, "heldout_baseline_acceptance": initial}


def test_goal_window_by_hand() -> None:
    # the docstring's example, out of order, with a step that has no paired decode
    records = [_step(5, 2.4, 2.0), {"step": 6, "heldout_acceptance": 3.0}, _step(3, 2.0, 2.0), _step(4, 2.6, 2.0)]
    got = goal_window(records)
    assert got["steps"] == [4, 5]
    assert got["margin_mean"] == pytest.approx(0.5)
    assert got["margin_sd"] == pytest.approx(math.sqrt(0.02))  # deviations +-0.1, n - 1 = 1
    assert got["gain_min"] == pytest.approx(1.2)
    assert got["gain_mean"] == pytest.approx(1.25)
    assert (got["at_or_above"], got["met"]) == (1, False)


def test_goal_window_counts_from_the_step_given_and_is_met_only_when_every_step_is() -> None:
    records = [_step(1, 1.0, 2.0), _step(2, 2.6, 2.0), _step(3, 3.0, 2.0)]
    assert goal_window(records, from_step=2) | {"margin_sd": None} == {
        "from_step": 2, "ratio": 1.3, "steps": [2, 3], "margin_mean": pytest.approx(0.8), "margin_sd": None,
        "gain_min": pytest.approx(1.3), "gain_mean": pytest.approx(1.4), "at_or_above": 2, "met": True}
    assert goal_window(records, from_step=1)["met"] is False  # step 1's gain is 0.5
    assert goal_window(records, from_step=3)["margin_sd"] == 0.0  # one step


def test_goal_window_refuses_no_steps_and_mixed_arms() -> None:
    with pytest.raises(ValueError, match="no paired validation step >= 4"):
        goal_window([_step(3, 2.0, 2.0)])
    with pytest.raises(ValueError, match="repeat"):
        goal_window([_step(4, 2.0, 2.0), _step(4, 2.6, 2.0)])
