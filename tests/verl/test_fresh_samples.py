"""`FreshPrompts`: the training prompts of `drafter.fresh_samples`, in a seeded order of their own, one
response each, collated by verl's own `collate_fn` and turned into the TensorDict its agent loop reads.
The end-to-end run (fresh rows captured, trained on in the step's round, served) is in test_cpu_grpo.py."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset

from verl_speco.online.config import DrafterConfigError, DrafterRunConfig
from verl_speco.verl_integration.fresh_samples import ROLLOUT_N_KEY, FreshPrompts, check_trainer_mode


class _Prompts(Dataset):
    """What verl's RLHFDataset items carry that matters here: tensors, a raw prompt and an index."""

    def __init__(self, size: int):
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> dict[str, Any]:
        return {"input_ids": torch.full((4,), i), "raw_prompt": [{"role": "user", "content": f"q{i}"}], "index": i}


def _indices(prompts: FreshPrompts, batches: int) -> list[list[int]]:
    return [[int(i) for i in prompts.next_dict()["index"]] for _ in range(batches)]


def test_the_same_seed_gives_the_same_prompts_and_another_seed_others() -> None:
    a, b, c = (FreshPrompts(_Prompts(12), 4, seed) for seed in (0, 0, 1))
    first = _indices(a, 6)
    assert first == _indices(b, 6)
    assert first != _indices(c, 6)


def test_each_pass_draws_every_prompt_at_most_once_then_reshuffles() -> None:
    prompts = FreshPrompts(_Prompts(10), 3, seed=5)
    batches = _indices(prompts, 6)  # 10 // 3 = 3 full batches a pass (the last prompt of each pass is left)
    for one_pass in (batches[:3], batches[3:]):
        drawn = [i for batch in one_pass for i in batch]
        assert len(drawn) == 9 and len(set(drawn)) == 9 and set(drawn) <= set(range(10))
    assert batches[:3] != batches[3:]  # a new shuffle, not the first pass again


def test_one_response_each_a_fresh_uid_each_and_the_step_attached() -> None:
    prompts = FreshPrompts(_Prompts(8), 4, seed=0)
    raw = prompts.next_dict()
    assert [int(n) for n in raw[ROLLOUT_N_KEY]] == [1, 1, 1, 1]
    batch = prompts.next_batch(global_steps=7)
    uids = list(raw["uid"]) + list(batch["uid"])
    assert len(set(uids)) == 8
    assert len(batch) == 4 and batch["global_steps"] == 7
    assert batch["input_ids"].shape == (4, 4)
    assert [int(n) for n in batch[ROLLOUT_N_KEY]] == [1, 1, 1, 1]


@pytest.mark.parametrize("count", [0, 9])
def test_a_count_outside_the_training_set_is_refused_naming_the_field(count: int) -> None:
    expected = (f"actor_rollout_ref.rollout.drafter.fresh_samples: got {count}, expected 1 to 8 "
                "(the training set's prompts)")
    with pytest.raises(DrafterConfigError, match=re.escape(expected)):
        FreshPrompts(_Prompts(8), count, seed=0)


def test_only_the_sync_trainer_takes_fresh_samples() -> None:
    on, off = DrafterRunConfig(enable=True, fresh_samples=4), DrafterRunConfig(enable=True)
    check_trainer_mode(on, "sync")
    for mode in ("colocate_async", "separate_async"):
        check_trainer_mode(off, mode)
        expected = (f"actor_rollout_ref.rollout.drafter.fresh_samples: got 4 with trainer.v1.trainer_mode={mode}, "
                    "expected 0 (fresh samples run between the sync trainer's weight sync and its validation: "
                    "trainer_mode=sync)")
        with pytest.raises(DrafterConfigError, match=re.escape(expected)):
            check_trainer_mode(on, mode)
