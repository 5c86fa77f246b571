"""RNG states as safetensors (torch generators, uint8) + JSON (python `random`, numpy): no pickle."""

from __future__ import annotations

import random
from typing import Any

import numpy as np
import torch
from torch import Tensor


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def _python_state_to_json(state: tuple[Any, ...]) -> list[Any]:
    version, internal, gauss = state
    return [version, list(internal), gauss]


def _numpy_state_to_json(state: Any) -> list[Any]:
    name, keys, pos, has_gauss, cached = state
    return [name, [int(k) for k in keys], int(pos), int(has_gauss), float(cached)]


ACCELERATORS = ("cuda", "npu")  # torch.<name> modules whose per-device generators a checkpoint keeps


def _generator_module(name: str) -> Any | None:
    """torch.cuda / torch.npu when that accelerator is usable, else None. torch.npu exists only once
    torch_npu is imported, which a process training on NPUs has done (`verl_speco.device`)."""
    module = getattr(torch, name, None)
    return module if module is not None and module.is_available() else None


def _keys(tensors: dict[str, Tensor], name: str) -> list[str]:
    """`torch_<name>_<i>` keys in device order."""
    prefix = f"torch_{name}_"
    found = [k for k in tensors if k.startswith(prefix) and k[len(prefix):].isdigit()]
    return sorted(found, key=lambda k: int(k[len(prefix):]))


def capture_rng() -> tuple[dict[str, Tensor], dict[str, Any]]:
    """(tensors, json) for the calling process: torch CPU and per-device CUDA / NPU generators (keys
    torch_cuda_<i>, torch_npu_<i>; only where that runtime is initialised), python, numpy."""
    tensors = {"torch_cpu": torch.get_rng_state()}
    for name in ACCELERATORS:
        module = _generator_module(name)
        if module is not None and module.is_initialized():
            for i, s in enumerate(module.get_rng_state_all()):
                tensors[f"torch_{name}_{i}"] = s
    meta = {"python": _python_state_to_json(random.getstate()),
            "numpy": _numpy_state_to_json(np.random.get_state(legacy=True))}
    return tensors, meta


def restore_rng(tensors: dict[str, Tensor], meta: dict[str, Any]) -> None:
    """Restore `capture_rng`'s states; a device's generators only where that accelerator is usable (a
    checkpoint resumed on another device type keeps that device's fresh streams)."""
    torch.set_rng_state(tensors["torch_cpu"])
    for device_name in ACCELERATORS:
        device_keys = _keys(tensors, device_name)
        module = _generator_module(device_name) if device_keys else None
        if module is not None:
            module.set_rng_state_all([tensors[k] for k in device_keys])
    version, internal, gauss = meta["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = meta["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
