"""Acceptance arithmetic against hand-computed figures (the worked example of spec_metrics)."""

from __future__ import annotations

import json
import math

import pytest

from verl_speco.engines.spec_metrics import SpecCounters, acceptance_summary


def _from_drafts(accepted: list[int], k: int) -> SpecCounters:
    """Counters of drafts of k tokens accepting `accepted[d]` tokens each, tallied by hand."""
    per_pos = [sum(1 for a in accepted if a > i) for i in range(k)]
    return SpecCounters(len(accepted), k * len(accepted), sum(accepted), tuple(per_pos))


def test_worked_example() -> None:
    counters = _from_drafts([3, 1, 0, 2], k=3)
    assert counters == SpecCounters(4, 12, 6, (3, 2, 1))
    s = acceptance_summary(counters)
    assert s["mean_acceptance_length"] == 2.5
    assert s["per_position_acceptance_rate"] == [0.75, 0.5, 0.25]
    assert s["draft_acceptance_rate"] == 0.5


def test_delta_of_two_snapshots_is_the_second_run() -> None:
    first, second = _from_drafts([3, 3], k=3), _from_drafts([0, 1, 0], k=3)
    total = SpecCounters(5, 15, 7, tuple(a + b for a, b in zip(first.accepted_per_pos, second.accepted_per_pos)))
    assert total - first == second
    assert acceptance_summary(total - first)["mean_acceptance_length"] == pytest.approx(1 + 1 / 3)
    assert SpecCounters(2, 6, 1, (1, 0, 0)) - SpecCounters() == SpecCounters(2, 6, 1, (1, 0, 0))


def test_counters_going_backwards_are_an_error() -> None:
    with pytest.raises(ValueError, match="different engines"):
        _from_drafts([1], k=3) - _from_drafts([3, 3], k=3)


def test_no_drafts_gives_nan_not_a_crash() -> None:
    s = acceptance_summary(SpecCounters())
    assert s["num_drafts"] == 0 and math.isnan(s["mean_acceptance_length"]) and s["per_position_acceptance_rate"] == []


def test_counters_add_and_round_trip_as_json() -> None:
    a = SpecCounters(3, 9, 4, (3, 1))
    b = SpecCounters(2, 6, 5, (2, 2, 1))
    assert a + b == SpecCounters(5, 15, 9, (5, 3, 1))
    assert SpecCounters.from_dict(json.loads(json.dumps((a + b).to_dict()))) == a + b
