"""Loss sums vs explicit loops; global-batch normalisation; acceptance metrics in vLLM's convention."""

from __future__ import annotations

import torch

from drafters.common.losses import ObjectiveOutput, geometric_weights, masked_match_count
from drafters.common.metrics import AcceptanceStats, simulated_acceptance_length


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
