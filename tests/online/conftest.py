"""Fixtures for the online co-training tests: the embedded tiny target (real HF Qwen3, float32).

`verl_speco.target.ensure_target()` returns the cached build (8 layers, hidden 128, vocab 505).
Tiny models run faster on one intra-op thread than on two busy cores (restored after each test).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch._C.set_num_threads(1)
    yield
    torch._C.set_num_threads(before)


@pytest.fixture(scope="session")
def target_dir() -> Path:
    from verl_speco.target import ensure_target

    return Path(ensure_target())


@pytest.fixture(scope="session")
def target_model(target_dir: Path):  # type: ignore[no-untyped-def]
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
