"""Fresh samples (`drafter.fresh_samples=N`): after the weight sync, one response of the updated policy to
each of N training prompts (a seeded order of their own), captured by the updated actor and trained on with
the step's rows, so the next draft does not lag a format change of the policy by a step."""

from __future__ import annotations

import uuid
from collections.abc import Iterator, Sized
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset
from verl.utils import tensordict_utils as tu
from verl.utils.dataset.rl_dataset import collate_fn

from verl_speco.online.config import DrafterConfigError, DrafterRunConfig

ROLLOUT_N_KEY = "__rollout_n__"  # verl's agent loop: responses per prompt, overriding rollout.n


class FreshPrompts:
    """Batches of `count` training prompts for fresh samples: a seeded shuffle of `dataset`, reshuffled
    at every pass over it (the same seed gives the same prompts at every step), one response each."""

    def __init__(self, dataset: Dataset, count: int, seed: int):
        size = len(dataset) if isinstance(dataset, Sized) else 0
        if not 1 <= count <= size:
            raise DrafterConfigError(f"actor_rollout_ref.rollout.drafter.fresh_samples: got {count}, expected "
                                     f"1 to {size} (the training set's prompts)")
        self.count = count
        self._loader = DataLoader(dataset, batch_size=count, shuffle=True, drop_last=True, collate_fn=collate_fn,
                                  generator=torch.Generator().manual_seed(int(seed)), num_workers=0)
        self._it: Iterator[dict[str, Any]] | None = None

    def next_dict(self) -> dict[str, Any]:
        """The next `count` prompts, collated as verl's dataloader gives them, one response each."""
        if self._it is None:
            self._it = iter(self._loader)
        try:
            batch = next(self._it)
        except StopIteration:
            self._it = iter(self._loader)
            batch = next(self._it)
        batch["uid"] = np.array([str(uuid.uuid4()) for _ in range(self.count)], dtype=object)
        batch[ROLLOUT_N_KEY] = np.array([1] * self.count, dtype=object)
        return batch

    def next_batch(self, global_steps: int) -> Any:
        """`next_dict` as the TensorDict verl's agent loop manager generates from."""
        batch = tu.get_tensordict(self.next_dict())
        tu.assign_non_tensor_data(batch, "global_steps", int(global_steps))
        return batch



def check_trainer_mode(drafter: DrafterRunConfig, trainer_mode: str) -> None:
    """Fresh samples run between the sync trainer's weight sync (`on_step_end`) and its validation; the
    async trainers resume generation there, so they are refused before anything starts."""
    if drafter.fresh_samples and trainer_mode != "sync":
        raise DrafterConfigError(f"actor_rollout_ref.rollout.drafter.fresh_samples: got {drafter.fresh_samples} with "
                                 f"trainer.v1.trainer_mode={trainer_mode}, expected 0 (fresh samples run between "
                                 "the sync trainer's weight sync and its validation: trainer_mode=sync)")
