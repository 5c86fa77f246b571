"""Exact resume on NPUs: the per-device NPU generator states go through a checkpoint's RNG files.

No NPU here: `torch.npu` is a fake holding two generator states (uint8 tensors, as torch_npu's
`get_rng_state_all` returns), saved and loaded with safetensors exactly as `train/checkpoint.py` does.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from verl_speco.train.rng import capture_rng, restore_rng


class FakeNpuRng:
    def __init__(self, available: bool = True) -> None:
        self.available = available
        self.states = [torch.arange(16, dtype=torch.uint8), torch.arange(16, 32, dtype=torch.uint8)]
        self.restored: list[list[torch.Tensor]] = []

    def is_available(self) -> bool:
        return self.available

    def is_initialized(self) -> bool:
        return self.available

    def get_rng_state_all(self) -> list[torch.Tensor]:
        return [s.clone() for s in self.states]

    def set_rng_state_all(self, states: list[torch.Tensor]) -> None:
        self.restored.append([s.clone() for s in states])
        self.states = [s.clone() for s in states]


def test_npu_generator_states_round_trip_through_a_checkpoint(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    npu = FakeNpuRng()
    monkeypatch.setattr(torch, "npu", npu, raising=False)
    saved = [s.clone() for s in npu.states]
    tensors, meta = capture_rng()
    save_file(tensors, str(tmp_path / "rng_rank0.safetensors"))
    npu.states = [torch.full((16,), 99, dtype=torch.uint8)] * 2  # the stream moved on after the save
    restore_rng(load_file(str(tmp_path / "rng_rank0.safetensors")), meta)
    assert len(npu.restored) == 1
    assert [s.tolist() for s in npu.states] == [s.tolist() for s in saved]  # device 0, then device 1


def test_npu_states_are_left_alone_where_no_npu_is_usable(monkeypatch: pytest.MonkeyPatch) -> None:
    npu = FakeNpuRng()
    monkeypatch.setattr(torch, "npu", npu, raising=False)
    tensors, meta = capture_rng()
    npu.available = False
    restore_rng(tensors, meta)  # e.g. an NPU checkpoint resumed on another device type
    assert npu.restored == []
