"""Draft vocab selection, d2t offsets, t2d, round trips, logits mapping, export rule."""

from __future__ import annotations

import pytest
import torch

from drafters.common.vocab import (
    DraftVocab,
    draft_logits_to_target,
    target_logits_to_draft,
    token_counts,
    token_counts_from_samples,
)


def test_worked_example_offsets() -> None:
    vocab = DraftVocab.select(torch.tensor([0, 5, 0, 9, 9, 1]), 3)
    assert vocab.target_ids.tolist() == [1, 3, 4]
    assert vocab.d2t.tolist() == [1, 2, 2]  # offsets, not ids
    assert vocab.t2d.tolist() == [False, True, False, True, True, False]
    assert vocab.draft_to_target(torch.tensor([0, 1, 2])).tolist() == [1, 3, 4]
    assert vocab.target_to_draft(torch.tensor([0, 1, 2, 3, 4, 5])).tolist() == [-1, 0, -1, 1, 2, -1]
    assert set(vocab.export_tensors()) == {"d2t", "t2d"}


def test_ties_and_unseen_tokens_go_to_lower_ids() -> None:
    vocab = DraftVocab.select(torch.tensor([2, 7, 2, 2, 0, 0]), 3)  # 1 first, then ties 0, 2 (not 3)
    assert vocab.target_ids.tolist() == [0, 1, 2]
    vocab = DraftVocab.select(torch.tensor([0, 0, 4, 0, 0, 0]), 3)  # only one seen token: fill 0, 1
    assert vocab.target_ids.tolist() == [0, 1, 2]


def test_round_trip_random() -> None:
    g = torch.Generator().manual_seed(3)
    counts = torch.randint(0, 50, (200,), generator=g)
    vocab = DraftVocab.select(counts, 37)
    draft = torch.arange(37)
    assert torch.equal(vocab.target_to_draft(vocab.draft_to_target(draft)), draft)
    kept = torch.nonzero(vocab.t2d).flatten()
    assert torch.equal(vocab.draft_to_target(vocab.target_to_draft(kept)), kept)
    # the selected tokens are the most frequent: every kept count >= every dropped count
    assert int(counts[vocab.t2d].min()) >= int(counts[~vocab.t2d].max())


def test_identity_and_export_rule() -> None:
    vocab = DraftVocab.identity(5)
    assert vocab.d2t.tolist() == [0] * 5 and vocab.t2d.all()
    assert vocab.is_full and vocab.export_tensors() == {}
    assert DraftVocab.select(torch.tensor([3, 1, 2, 0, 0]), 5).d2t.tolist() == [0] * 5
    with pytest.raises(ValueError, match="expected within"):  # an arange d2t is NOT the identity: 2 -> 4
        DraftVocab(torch.arange(3), torch.ones(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="t2d: does not mark exactly the targets"):
        DraftVocab(torch.tensor([0, 0]), torch.tensor([True, False, True]))


def test_logits_mapping_both_ways() -> None:
    vocab = DraftVocab.from_target_ids(torch.tensor([4, 1, 3]), 6)
    target_logits = torch.tensor([[0.0, 1.0, 2.0, 3.0, 4.0, 5.0]])
    assert target_logits_to_draft(target_logits, vocab.t2d).tolist() == [[1.0, 3.0, 4.0]]
    back = draft_logits_to_target(torch.tensor([[7.0, 8.0, 9.0]]), vocab.d2t, 6)
    inf = float("-inf")
    assert back.tolist() == [[inf, 7.0, inf, 8.0, 9.0, inf]]


def test_token_counts_use_loss_mask_only() -> None:
    ids = torch.tensor([1, 2, 2, 3, 3, 3])
    mask = torch.tensor([0, 1, 1, 0, 1, 1], dtype=torch.uint8)
    assert token_counts(ids, mask, 5).tolist() == [0, 0, 2, 2, 0]
    samples = [{"input_ids": ids, "loss_mask": mask}, {"input_ids": torch.tensor([4]), "loss_mask": torch.tensor([1])}]
    assert token_counts_from_samples(samples, 5).tolist() == [0, 0, 2, 2, 1]
    with pytest.raises(ValueError, match="input_ids"):
        token_counts(torch.tensor([9]), torch.tensor([1]), 5)
