"""`train_step`'s stage timing attributes time to the right stage: a model whose forward sleeps
0.3 s inside an objective that sleeps 0.1 s outside it.

Margins: sleeps are lower bounds whatever the load, so forward >= 0.3 and loss >= 0.1 always
hold; the upper bound loss < 0.3 separates the correct accounting (loss ~ 0.1 s) from counting
the forward twice (loss >= 0.4 s) with 0.2 s left for scheduling delays.
"""

from __future__ import annotations

import time
from typing import Any

import torch
from torch import Tensor, nn

from drafters.common.losses import ObjectiveOutput
from verl_speco.train.step import STAGES, train_step


class SleepyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(3))

    def forward(self, x: Tensor) -> Tensor:
        time.sleep(0.3)
        return (self.w * x).sum()


class SleepyFamily:
    def collate(self, samples: list[dict[str, Tensor]]) -> dict[str, Tensor]:
        return {"x": torch.stack([s["x"] for s in samples]).sum(0), "input_ids": torch.zeros(1, 2, dtype=torch.long),
                "loss_mask": torch.ones(1, 2)}

    def objective(self, model: nn.Module, batch: dict[str, Tensor], progress: float = 0.0) -> ObjectiveOutput:
        y = model(batch["x"])
        time.sleep(0.1)
        return ObjectiveOutput((y * y).view(1), torch.ones(1), torch.ones(1), {})


def test_stage_timing_attributes_forward_and_loss() -> None:
    model, family = SleepyModel(), SleepyFamily()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    samples: list[dict[str, Any]] = [{"x": torch.tensor([1.0, 2.0, 3.0])}]
    t0 = time.perf_counter()
    res = train_step(model, family, [samples], opt, 1.0, torch.device("cpu"))
    wall = time.perf_counter() - t0
    assert set(res.timing) == set(STAGES)
    assert res.timing["forward"] >= 0.3 and res.timing["loss"] >= 0.1
    assert res.timing["loss"] < 0.3  # the forward is not counted in the loss stage
    assert all(v >= 0 for v in res.timing.values()) and sum(res.timing.values()) <= wall
    assert not torch.equal(model.w.detach(), torch.ones(3))  # the step ran
