"""LR schedule (golden values), optimizer-state flattening and RNG capture round trips."""

from __future__ import annotations

import math
import random
from typing import Any

import numpy as np
import pytest
import torch

from verl_speco.train.checkpoint import flatten_optimizer_state, unflatten_optimizer_state
from verl_speco.train.config import OptimConfig
from verl_speco.train.optim import lr_at
from verl_speco.train.rng import capture_rng, restore_rng


def test_linear_schedule_worked_example() -> None:
    cfg = OptimConfig(lr=1.0, schedule="linear", min_lr_ratio=0.0)
    assert [lr_at(s, cfg, 6, 2) for s in range(6)] == pytest.approx([0.5, 1.0, 1.0, 2 / 3, 1 / 3, 0.0])


def test_cosine_and_constant_schedules() -> None:
    cos = OptimConfig(lr=2.0, schedule="cosine", min_lr_ratio=0.1)
    # no warmup, 5 steps: progress 0, 1/4, 1/2, 3/4, 1 -> 2 * (0.1 + 0.9 * (1 + cos(pi p)) / 2)
    want = [2.0 * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p))) for p in (0, 0.25, 0.5, 0.75, 1.0)]
    assert [lr_at(s, cos, 5, 0) for s in range(5)] == pytest.approx(want)
    assert lr_at(4, cos, 5, 0) == pytest.approx(0.2)
    const = OptimConfig(lr=3.0, schedule="constant")
    assert [lr_at(s, const, 10, 4) for s in (0, 3, 4, 9)] == pytest.approx([0.75, 3.0, 3.0, 3.0])


def test_optimizer_state_flatten_round_trip() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1, betas=(0.9, 0.95))
    model(torch.randn(5, 3)).square().sum().backward()
    opt.step()
    state = {f"p{i}": s for i, s in opt.state_dict()["state"].items()}
    groups = [{**g, "params": [f"p{i}" for i in g["params"]]} for g in opt.state_dict()["param_groups"]]
    osd: dict[str, Any] = {"state": state, "param_groups": groups}
    tensors, meta = flatten_optimizer_state(osd)
    assert set(tensors) == {f"p{i}/{k}" for i in range(4) for k in ("step", "exp_avg", "exp_avg_sq")}
    back = unflatten_optimizer_state(tensors, meta)
    assert back["param_groups"][0]["betas"] == (0.9, 0.95)
    for fqn, entry in state.items():
        for k, v in entry.items():
            assert torch.equal(back["state"][fqn][k], v)


def test_rng_round_trip() -> None:
    torch.manual_seed(5)
    random.seed(6)
    np.random.seed(7)
    tensors, meta = capture_rng()
    want = (torch.rand(3), random.random(), np.random.rand())
    torch.rand(10), random.random(), np.random.rand()
    restore_rng(tensors, meta)
    got = (torch.rand(3), random.random(), np.random.rand())
    assert torch.equal(got[0], want[0]) and got[1:] == want[1:]
