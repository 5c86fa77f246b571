"""Drafter tests use tiny tensors: one intra-op thread is faster than contending for the cores."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def _single_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch._C.set_num_threads(1)
    yield
    torch._C.set_num_threads(before)
