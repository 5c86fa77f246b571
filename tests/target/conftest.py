"""Shared fixtures: one fast-built target per test session (real training, few steps)."""

from __future__ import annotations

from pathlib import Path

import pytest

from verl_speco.target.build import ensure_target, fast_recipe


@pytest.fixture(scope="session")
def fast_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An HF directory holding the fast recipe's target, built into a session-private cache."""
    return ensure_target(fast_recipe(), cache_dir=tmp_path_factory.mktemp("verl_speco_cache"))
