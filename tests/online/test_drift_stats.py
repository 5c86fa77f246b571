"""The drift studies' statistics (experiments/drift_stats.py), against figures worked by hand."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from experiments.drift_stats import (
    goal_window,
    paired_difference,
    paired_gains,
    paired_records,
    reachability,
    wilson_interval,
)


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


@pytest.mark.parametrize(("successes", "trials", "low", "high"), [
    (81, 263, 0.2553, 0.3662), (15, 148, 0.0624, 0.1605), (0, 20, 0.0, 0.1611), (1, 29, 0.0061, 0.1718)])
def test_wilson_interval_matches_newcombes_table(successes: int, trials: int, low: float, high: float) -> None:
    # Newcombe (1998), Statistics in Medicine 17:857, Table I, method 3 (score interval without continuity correction)
    got = wilson_interval(successes, trials)
    assert got == (pytest.approx(low, abs=5e-5), pytest.approx(high, abs=5e-5))


def test_wilson_interval_by_hand_and_at_the_edges() -> None:
    assert wilson_interval(2, 7) == (pytest.approx(0.0822, abs=5e-5), pytest.approx(0.6411, abs=5e-5))  # docstring
    low, high = wilson_interval(4, 4)
    assert high == 1.0 and low == pytest.approx(1 / (1 + 1.96**2 / 4))  # all met: centre + half-width is exactly 1
    low, high = wilson_interval(3, 6)
    assert low + high == pytest.approx(1.0)  # half met: symmetric about 0.5
    for bad in ((1, 0), (5, 4), (-1, 4)):
        with pytest.raises(ValueError, match="expected 0 <= successes <= trials and trials >= 1"):
            wilson_interval(*bad)


def test_paired_records_keep_one_arm_with_its_initial_draft_and_refuse_a_bad_line(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    rows = [{"arm": "cotrained", "step": 0, "heldout_acceptance": 2.0, "heldout_baseline_acceptance": 2.0},
            {"arm": "frozen", "step": 0, "heldout_acceptance": 9.0, "heldout_baseline_acceptance": 9.0},
            {"arm": "cotrained", "step": 1, "heldout_acceptance": 2.5}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")
    assert paired_records(path) == rows[:1]
    assert paired_records(path, "frozen") == rows[1:2]
    path.write_text(json.dumps(rows[0]) + "\n{cut\n")
    with pytest.raises(ValueError, match=r"metrics\.jsonl:2: not a JSON line"):
        paired_records(path)


def test_paired_gains_by_step_skipping_unpaired_records() -> None:
    records = [_step(5, 3.0, 2.0), {"step": 4, "heldout_acceptance": 9.0}, _step(2, 2.0, 2.5)]
    assert paired_gains(records) == [(2, pytest.approx(0.8)), (5, pytest.approx(1.5))]


def test_reachability_splits_the_window_and_keeps_each_steps_ceiling() -> None:
    gains = [(3, 1.0), (4, 1.25), (5, 1.4), (6, 1.3)]
    out = reachability(gains, {3: 1.9, 4: 1.32, 5: 1.8, 6: 1.5})
    assert out == {"met": [(5, 1.4, 1.8), (6, 1.3, 1.5)], "missed": [(4, 1.25, 1.32)]}  # 1.3 itself meets it
    assert reachability(gains, {4: 1.32, 5: 1.8, 6: 1.5})["missed"] == [(4, 1.25, 1.32)]  # step 3: outside
    with pytest.raises(ValueError, match="no reachable gain for step 5"):
        reachability(gains, {4: 1.32, 6: 1.5})
