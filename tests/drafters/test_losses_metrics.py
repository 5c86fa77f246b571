"""Loss sums vs explicit loops; global-batch normalisation; acceptance metrics in vLLM's convention."""

from __future__ import annotations

import random

import pytest
import torch

from drafters.common.losses import ObjectiveOutput, geometric_weights, masked_match_count
from drafters.common.metrics import (
    AcceptanceStats,
    prompt_bootstrap_interval,
    reachable_chain_counts,
    simulated_acceptance_length,
    tokens_per_target_forward,
)


def test_loss_with_global_denominators_matches_single_batch() -> None:
    w = geometric_weights(2, 0.8)
    assert w.tolist() == [1.0, 0.800000011920929]
    whole = ObjectiveOutput(torch.tensor([6.0, 3.0]), torch.tensor([4.0, 2.0]), w)
    part1 = ObjectiveOutput(torch.tensor([5.0, 3.0]), torch.tensor([3.0, 2.0]), w)
    part2 = ObjectiveOutput(torch.tensor([1.0, 0.0]), torch.tensor([1.0, 0.0]), w)
    global_den = part1.denominators + part2.denominators
    summed = part1.loss(global_den) + part2.loss(global_den)
    assert abs(float(summed) - float(whole.loss())) < 1e-6
    assert abs(float(whole.loss()) - (6 / 4 + 0.8 * 3 / 2)) < 1e-6
    assert float(part2.loss()) == 1.0  # the empty term contributes 0, not NaN


def test_masked_match_count() -> None:
    got = masked_match_count(torch.tensor([1, 2, 3, 4]), torch.tensor([1, 0, 3, 4]), torch.tensor([1, 1, 1, 0]))
    assert [float(x) for x in got] == [2.0, 3.0]


def test_acceptance_stats_worked_example() -> None:
    stats = AcceptanceStats()
    stats.record(3, 3)
    stats.record(3, 1)
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted) == (2, 6, 4)
    assert stats.accepted_per_pos == [2, 1, 1]
    assert stats.mean_acceptance_length == 3.0
    assert stats.per_position_acceptance == [1.0, 0.5, 0.5]
    assert abs(stats.draft_acceptance_rate - 4 / 6) < 1e-12
    merged = stats.merge(AcceptanceStats(1, 2, 0, [0, 0]))
    assert merged.accepted_per_pos == [2, 1, 1] and merged.mean_acceptance_length == 1 + 4 / 3


def test_simulated_acceptance_length_vs_loop() -> None:
    correct = torch.tensor([[1, 1, 0], [1, 0, 1], [1, 1, 1]], dtype=torch.bool)
    valid = torch.ones(3, 3, dtype=torch.bool)
    total, rows = simulated_acceptance_length(correct, valid)
    assert (float(total), float(rows)) == (7.0, 3.0)
    assert float(simulated_acceptance_length(correct, valid, num_speculative_tokens=1)[0]) == 5.0
    g = torch.Generator().manual_seed(1)
    correct = torch.rand(4, 2, 6, generator=g) < 0.7
    valid = torch.rand(4, 2, 6, generator=g) < 0.9
    ref_total, ref_rows = 0, 0
    for b in range(2):
        for t in range(6):
            if not valid[0, b, t]:
                continue
            run = 0
            while run < 4 and correct[run, b, t] and valid[run, b, t]:
                run += 1
            ref_total, ref_rows = ref_total + 1 + run, ref_rows + 1
    total, rows = simulated_acceptance_length(correct, valid)
    assert (float(total), float(rows)) == (ref_total, ref_rows)


def test_prompt_bootstrap_interval_by_hand() -> None:
    # the docstring's example: pooled values 2.0 (p 1/4), 1.333 (p 1/2), 1.0 (p 1/4) -> 90% interval (1.0, 2.0)
    assert prompt_bootstrap_interval([10, 10], [5, 0]) == (1.0, 2.0)
    # at 40% the quantiles 0.3 and 0.7 both fall among the mixed resamples (the middle half): each end's
    # share is 1/4 with a standard deviation of 0.01 at 2000 resamples, 5 of them inside the 0.05 margin
    low, high = prompt_bootstrap_interval([10, 10], [5, 0], level=0.4)
    assert low == high == pytest.approx(20 / 15)
    # identical prompts: every resample pools to the same value
    assert prompt_bootstrap_interval([8, 8, 8], [4, 4, 4]) == (2.0, 2.0)
    # seeded: the same counts give the same interval; it brackets the pooled figure of all prompts
    generated, accepted = [64, 40, 64, 12, 64, 30], [30, 5, 41, 2, 20, 14]
    interval = prompt_bootstrap_interval(generated, accepted)
    assert interval == prompt_bootstrap_interval(generated, accepted)
    pooled = tokens_per_target_forward(sum(generated), sum(accepted), len(generated))
    assert interval[0] < pooled < interval[1]
    assert prompt_bootstrap_interval(generated, accepted, level=0.5)[1] < interval[1]


def test_prompt_bootstrap_interval_refuses_bad_counts() -> None:
    with pytest.raises(ValueError, match="1 generated and 1 accepted"):
        prompt_bootstrap_interval([10], [2])
    with pytest.raises(ValueError, match="prompt 1 has generated=4, accepted=4"):
        prompt_bootstrap_interval([10, 4], [2, 4])
    with pytest.raises(ValueError, match="level=1.0"):
        prompt_bootstrap_interval([10, 4], [2, 1], level=1.0)


def _verify_loop(target: list[int], draftable: list[bool], k: int) -> tuple[int, int]:
    """vLLM-style greedy verification with explicit proposals: the draft proposes target[j] at depth 1 or where
    draftable, else -1; the target accepts proposals equal to its own tokens, then emits its own next token."""
    out, accepted, drafts = [target[0]], 0, 0
    while len(out) < len(target):
        i = len(out)
        proposals = [target[j] if j < len(target) and (d == 0 or draftable[j]) else -1
                     for d, j in enumerate(range(i, i + k))]
        run = 0
        for d, tok in enumerate(proposals):
            if i + d >= len(target) or tok != target[i + d]:
                break
            run += 1
        accepted, drafts = accepted + run, drafts + 1
        out += target[i: i + run + 1]
    assert out == target  # lossless
    return accepted, drafts


def test_reachable_chain_counts_worked_example_and_reference() -> None:
    sum_digits = [True] * 6 + [False, False, True]  # "7 + 4 = 11<eos>": the two digits of the sum
    assert reachable_chain_counts(sum_digits, 3) == (6, 3)
    assert reachable_chain_counts([True] * 9, 3) == (6, 2)  # everything draftable: 3 + bonus, twice
    assert reachable_chain_counts([True], 3) == (0, 0)  # the prefill's token only
    assert reachable_chain_counts([False] * 5, 3) == (2, 2)  # depth 1 only: 1 + bonus per forward
    rng = random.Random(0)
    for _ in range(300):
        n, k = rng.randint(1, 40), rng.randint(1, 7)
        draftable = [rng.random() < 0.7 for _ in range(n)]
        assert reachable_chain_counts(draftable, k) == _verify_loop(list(range(n)), draftable, k), (draftable, k)
    with pytest.raises(ValueError, match="k: got 0"):
        reachable_chain_counts([True], 0)
