"""Capture's device-to-host copies are awaited on every accelerator, with a faked `torch.npu`.

`OnlineCapture.collect` copies the kept rows into pinned host memory without blocking; `wait()` (and
`to_bytes()`, which the actor worker calls) must block on an event recorded after those copies.
There is no NPU here: the captured activations are a tensor subclass that reports device npu:1 (as
a forward on an Ascend worker gives them), `_to_host` is a plain copy, and `torch.npu` is a fake
whose Event records what happens to it. CUDA is made unavailable, as on an Ascend host.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

from verl_speco.capture.hooks import CapturedFeatures
from verl_speco.online import capture as capture_mod
from verl_speco.online.capture import CapturedRows, OnlineCapture
from verl_speco.online.config import CaptureCaps

NPU1 = SimpleNamespace(type="npu", index=1)  # torch.device("npu", 1) needs torch_npu's backend


class OnNpu(torch.Tensor):
    """A CPU tensor that reports device npu:1, as do the views taken from it."""

    @property
    def device(self) -> Any:  # type: ignore[override]
        return NPU1


class FakeEvent:
    def __init__(self, log: list[str]):
        self.log, self.stream = log, None

    def record(self, stream: Any = None) -> None:
        self.stream = stream
        self.log.append("record")

    def synchronize(self) -> None:
        self.log.append("synchronize")


class FakeNpuModule:
    def __init__(self) -> None:
        self.log: list[str] = []
        self.events: list[FakeEvent] = []

    def current_stream(self, device: Any) -> tuple[str, Any]:
        return ("stream", device)

    def Event(self) -> FakeEvent:  # noqa: N802 (torch.npu.Event)
        self.events.append(FakeEvent(self.log))
        return self.events[-1]


@pytest.fixture
def npu(monkeypatch: pytest.MonkeyPatch) -> FakeNpuModule:
    fake = FakeNpuModule()
    monkeypatch.setattr(torch, "npu", fake, raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(capture_mod, "_to_host", lambda t: t.as_subclass(torch.Tensor).clone())
    return fake


def test_rows_captured_on_an_npu_are_awaited_before_they_are_serialised(npu: FakeNpuModule,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    am = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 0]])
    lm = torch.tensor([[0, 0, 1, 1], [0, 1, 1, 0]])
    ids = torch.arange(8).reshape(2, 4)
    nnz = int(am.sum())  # remove-padding layout: [1, nnz, H]
    last = torch.randn(1, nnz, 4).as_subclass(OnNpu)
    aux = torch.randn(1, nnz, 4).as_subclass(OnNpu)
    feats = CapturedFeatures((0,), {0: aux}, last)
    caps = CaptureCaps(max_rows=8, max_tokens=100, min_response_tokens=1, max_seq_len=100)
    rows = OnlineCapture((0,), caps).collect([feats], ids, am, lm, policy_version=3)

    assert len(npu.events) == 1 and npu.log == ["record"]  # recorded after the copies, not yet awaited
    assert npu.events[0].stream == ("stream", NPU1)  # on the stream of the device the copies came from
    serialised_after: list[list[str]] = []
    save = capture_mod.safetensors_save

    def save_spy(*args: Any, **kwargs: Any) -> bytes:
        serialised_after.append(list(npu.log))
        return save(*args, **kwargs)

    monkeypatch.setattr(capture_mod, "safetensors_save", save_spy)
    data = rows.to_bytes()
    assert serialised_after == [["record", "synchronize"]]
    rows.wait()
    assert npu.log == ["record", "synchronize"]  # awaited once
    back = CapturedRows.from_bytes(data)
    assert [r["input_ids"].tolist() for r in back.records] == [[1, 2, 3], [4, 5, 6]]
    assert torch.equal(back.records[1]["last_hidden"], last.as_subclass(torch.Tensor)[0, 3:6])


def test_cpu_rows_need_no_event(npu: FakeNpuModule) -> None:
    feats = CapturedFeatures((0,), {0: torch.randn(1, 3, 4)}, torch.randn(1, 3, 4))
    ones = torch.ones(1, 3, dtype=torch.int64)
    rows = OnlineCapture((0,), CaptureCaps()).collect([feats], ones, ones, ones, policy_version=0)
    assert rows._event is None and npu.events == []  # nothing was in flight
