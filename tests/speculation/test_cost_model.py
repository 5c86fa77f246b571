"""The speculation cost model against figures worked out by hand (step times of a made-up engine)."""

from __future__ import annotations

import pytest

from drafters.common.metrics import expected_tokens_per_step
from verl_speco.speculation.cost_model import (
    StepTimes,
    best_k,
    k_of_schedule,
    schedule_ranges,
    simulate,
    tokens_per_s,
)
from verl_speco.speculation.plan import Calibration, plan

RATES = (0.8, 0.5)
TIMES = StepTimes(batch_sizes=(1, 4), plain_step_s=(0.010, 0.016),
                  draft_step_s=((0.011, 0.018), (0.014, 0.030), (0.017, 0.045)),
                  plain_prefill_s=(0.04, 0.07), draft_prefill_s=(0.05, 0.08))


def test_expected_tokens_per_step() -> None:
    assert expected_tokens_per_step([0.8, 0.6, 0.3], 2) == pytest.approx(2.4)
    assert expected_tokens_per_step([0.8, 0.6, 0.3], 3) == pytest.approx(2.7)
    assert expected_tokens_per_step([0.8, 0.6, 0.3], 0) == 1.0
    with pytest.raises(ValueError, match="k: got 4"):
        expected_tokens_per_step([0.8, 0.6, 0.3], 4)
    with pytest.raises(ValueError, match="non-increasing"):
        expected_tokens_per_step([0.5, 0.6], 2)


def test_step_times_interpolate_and_extrapolate() -> None:
    assert TIMES.step_s(2, None) == pytest.approx(0.012)
    assert TIMES.step_s(3, 1) == pytest.approx(0.014 + 0.016 * 2 / 3)
    assert TIMES.step_s(8, None) == pytest.approx(0.010 + 0.006 * 7 / 3)  # the last segment continued
    assert TIMES.prefill_s(2, drafting=True) == pytest.approx(0.06)
    assert TIMES.k_max == 2
    with pytest.raises(ValueError, match="k: got 3"):
        TIMES.step_s(1, 3)


def test_tokens_per_s_and_best_k_by_hand() -> None:
    assert tokens_per_s(TIMES, RATES, 1, None) == pytest.approx(100.0)
    assert tokens_per_s(TIMES, RATES, 1, 2) == pytest.approx(2.3 / 0.017)
    assert tokens_per_s(TIMES, RATES, 4, 1) == pytest.approx(4 * 1.8 / 0.030)
    # b=1: k2 135.3 > k1 128.6 > k0 90.9; b=2: k1 186.2 > k2 176.9; b=4: k1 240 > k0 222 > k2 204
    assert [best_k(TIMES, RATES, b, 0.05) for b in (1, 2, 3, 4)] == [2, 1, 1, 1]
    # b=3: k1 218.9 vs k0 191.5 (0.011 + 0.007 x 2/3 s) is a 14% gain: kept at a 10% margin, dropped at 15%
    assert best_k(TIMES, RATES, 3, 0.10) == 1
    assert best_k(TIMES, RATES, 3, 0.15) == 0
    # positions measured bound k: one rate -> k <= 1
    assert best_k(TIMES, (0.8,), 1, 0.0) == 1


def test_schedule_ranges_and_lookup() -> None:
    assert schedule_ranges([3, 3, 1, 0, 0]) == [(1, 2, 3), (3, 3, 1), (4, 5, 0)]
    k_of = k_of_schedule([(1, 2, 3), (3, 3, 1), (4, 5, 0)])
    assert [k_of(b) for b in (1, 2, 3, 4, 5, 9)] == [3, 3, 1, 0, 0, 0]


def test_plan_by_hand() -> None:
    p = plan(Calibration(TIMES, RATES, max_num_seqs=4))
    assert p.schedule == [(1, 1, 2), (2, 4, 1)]
    assert p.speculate and p.k_max == 2
    assert p.vllm_fields() == {"num_speculative_tokens": 2,
                               "num_speculative_tokens_per_batch_size": [[1, 1, 2], [2, 4, 1]]}
    assert p.describe() == "1: k=2, 2-4: k=1"
    # a draft that is never right: k = 0 everywhere, and the engine without a drafter is the plan
    never = plan(Calibration(TIMES, (0.0, 0.0), max_num_seqs=4))
    assert never.schedule == [(1, 4, 0)] and not never.speculate


def test_simulate_by_hand() -> None:
    k_of = k_of_schedule([(1, 1, 2), (2, 4, 1)])
    # prefill of 2 (drafting) 0.06; remaining [2, 4]; b=2 k=1 (+1.8): [0.2, 2.2], then [0.4]; b=1 k=2 (+2.3)
    assert simulate(TIMES, RATES, [3, 5], k_of, max_num_seqs=4) == pytest.approx(0.06 + 2 * (0.012 + 0.0220 / 3)
                                                                                 + 0.017)
    # plain: prefill 0.05; [2, 4] -> two steps at b=2 (0.012), two at b=1 (0.010)
    assert simulate(TIMES, RATES, [3, 5], lambda b: None, max_num_seqs=4) == pytest.approx(0.05 + 0.024 + 0.020)
    # a batch limit of 1: two waves, each a prefill of 1 (plain 0.04): 0.04 + 2 x 0.010 + 0.04 + 4 x 0.010
    assert simulate(TIMES, RATES, [3, 5], lambda b: None, max_num_seqs=1) == pytest.approx(0.14)


def test_bad_step_times_name_the_field() -> None:
    with pytest.raises(ValueError, match="plain_step_s"):
        StepTimes((1, 4), (0.01,), ((0.01, 0.02),), (0.1, 0.1), (0.1, 0.1))
    with pytest.raises(ValueError, match="batch_sizes"):
        StepTimes((4, 1), (0.01, 0.01), ((0.01, 0.02),), (0.1, 0.1), (0.1, 0.1))
    with pytest.raises(ValueError, match="draft_step_s"):
        StepTimes((1, 4), (0.01, 0.01), ((0.01, float("nan")),), (0.1, 0.1), (0.1, 0.1))


def test_calibration_file_round_trip_and_refusals(tmp_path) -> None:  # type: ignore[no-untyped-def]
    import json

    cal = Calibration(TIMES, RATES, max_num_seqs=4, info={"target": "t"})
    path = cal.write(tmp_path / "c.json")
    assert Calibration.read(path) == cal and not (tmp_path / "c.json.tmp").exists()
    raw = json.loads(path.read_text())
    for field, value, message in (("format", "x", "format: got 'x'"), ("version", 9, "version: got 9"),
                                  ("per_position", [1.5], "per_position: got"), ("max_num_seqs", 0, "max_num_seqs"),
                                  ("step_times", {"batch_sizes": [1]}, "step_times: missing")):
        bad = tmp_path / f"bad_{field}.json"
        bad.write_text(json.dumps({**raw, field: value}))
        with pytest.raises(ValueError, match=f"{bad}: {message}"):
            Calibration.read(bad)
    with pytest.raises(ValueError, match="not a readable calibration file"):
        Calibration.read(tmp_path / "missing.json")
    assert cal.with_acceptance([0.5]).per_position == (0.5,)


def test_long_tail_lengths_worked_example() -> None:
    from verl_speco.speculation.cost_model import long_tail_lengths

    assert long_tail_lengths(4, 48, 1.0, 200) == [15, 35, 66, 152]
    assert long_tail_lengths(3, 10, 0.0, 200) == [10, 10, 10]
    assert max(long_tail_lengths(32, 48, 0.9, 100)) == 100  # capped


def test_rollout_workload_worked_example() -> None:
    from verl_speco.speculation.apply import rollout_workload

    assert rollout_workload(4, 512) == [45, 96, 171, 360]
