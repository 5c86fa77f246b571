"""Accelerator probing: the only module that imports torch_npu (guarded; it breaks CPU installs)."""

from __future__ import annotations

import torch


def npu_device_count() -> int:
    """Visible Ascend NPUs; 0 when torch_npu is absent or unusable (ImportError/OSError/RuntimeError)."""
    try:
        import torch_npu  # noqa: F401
    except (ImportError, OSError, RuntimeError):
        return 0
    npu = getattr(torch, "npu", None)  # attached by torch_npu
    if npu is None or not npu.is_available():
        return 0
    return int(npu.device_count())


def accelerator_count() -> int:
    """CUDA devices if any, else NPUs, else 0."""
    if torch.cuda.is_available():
        return int(torch.cuda.device_count())
    return npu_device_count()
