"""Accelerator probing and the per-device choices built on it (collective backend and dtype, device
binding, Ray's accelerator request and index): the only module that imports torch_npu, and only inside
`_import_torch_npu`, where any failure counts as "no NPU" (a broken CANN install resolves to the CPU)."""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch

DEVICE_TYPES = ("cuda", "npu", "cpu")
BACKENDS = {"cuda": "nccl", "npu": "hccl", "cpu": "gloo"}
RAY_RESOURCES = {"cuda": "GPU", "npu": "NPU"}  # Ray's accelerator resource names
VISIBLE_DEVICES = {"cuda": "CUDA_VISIBLE_DEVICES", "npu": "ASCEND_RT_VISIBLE_DEVICES"}


def _import_torch_npu() -> Any:
    """torch_npu, imported on demand (tests replace this function to fake the probe)."""
    return importlib.import_module("torch_npu")


def npu_device_count() -> int:
    """Visible Ascend NPUs; 0 when torch_npu is absent or broken (any exception from its import or
    queries) or attached no `torch.npu`."""
    try:
        _import_torch_npu()
        npu = getattr(torch, "npu", None)  # attached by torch_npu
        if npu is None or not npu.is_available():
            return 0
        return int(npu.device_count())
    except Exception:  # noqa: BLE001 - a broken torch_npu means no NPU, never a crash
        return 0


def accelerator_type() -> str:
    """"cuda", "npu" or "cpu": what this process computes on when nothing is asked for."""
    if torch.cuda.is_available():
        return "cuda"
    return "npu" if npu_device_count() > 0 else "cpu"


def accelerator_count() -> int:
    """CUDA devices if any, else NPUs, else 0."""
    if torch.cuda.is_available():
        return int(torch.cuda.device_count())
    return npu_device_count()


def _check_type(device_type: str) -> str:
    if device_type not in DEVICE_TYPES:
        raise ValueError(f"device type: got {device_type!r}, expected one of {', '.join(DEVICE_TYPES)}")
    return device_type


def collective_backend(device_type: str) -> str:
    """The torch.distributed backend for `device_type`: nccl, hccl or gloo."""
    return BACKENDS[_check_type(device_type)]


def collective_dtype(dtype: torch.dtype, device_type: str) -> torch.dtype:
    """The dtype a sum or max of `dtype` tensors runs in on `device_type` (module docstring)."""
    _check_type(device_type)
    if dtype.is_floating_point:
        return torch.float32 if device_type == "npu" else torch.float64
    if dtype == torch.int64 and device_type == "npu":
        return torch.int32
    return dtype


def set_current_device(device_type: str, index: int) -> None:
    """Bind this process to accelerator `index` (nothing to do on the CPU)."""
    if _check_type(device_type) == "cuda":
        torch.cuda.set_device(index)
    elif device_type == "npu":
        npu: Any = getattr(torch, "npu")  # noqa: B009 (attached by torch_npu, absent from torch's stubs)
        npu.set_device(index)


def ray_accelerator_options(device_type: str, count: float) -> dict[str, Any]:
    """Ray actor options asking for `count` accelerators of `device_type`: Ray counts NPUs as the
    custom resource "NPU"; GPUs, and the CPU platform's stand-in GPUs, as num_gpus."""
    if _check_type(device_type) == "npu":
        return {"num_gpus": 0, "resources": {"NPU": count}}
    return {"num_gpus": count}


def local_accelerator_index(device_type: str, accelerator_ids: Mapping[str, Sequence[str]],
                            environ: Mapping[str, str]) -> int:
    """The torch index (cuda:i, npu:i) of the accelerator Ray assigned to this worker: the id's position in
    the visible-devices variable when set (Ray narrows it unless RAY_EXPERIMENTAL_NOSET_*), else the id.
    Worked example, NPU id "5": narrowed to "5" -> 0; NOSET "4,5,6,7" -> 1; NOSET, unset -> 5."""
    if device_type not in RAY_RESOURCES:
        raise ValueError(f"device type: got {device_type!r}, expected one of {', '.join(RAY_RESOURCES)}")
    resource, variable = RAY_RESOURCES[device_type], VISIBLE_DEVICES[device_type]
    ids = [str(i) for i in accelerator_ids.get(resource, [])]
    if not ids:
        raise ValueError(f"Ray's accelerator ids {dict(accelerator_ids)}: no {resource!r} id for this worker; "
                         f"expected at least one (was the actor started with a {resource} resource?)")
    visible = environ.get(variable)
    if visible is not None:
        listed = [v.strip() for v in visible.split(",")]
        missing = [i for i in ids if i not in listed]
        if missing:
            raise ValueError(f"{variable}={visible!r} does not list Ray's {resource} ids {missing}; expected "
                             f"the ids Ray assigned ({ids}) among the visible devices")
        return min(listed.index(i) for i in ids)
    if not all(i.isdigit() for i in ids):
        raise ValueError(f"Ray's {resource} ids {ids} with {variable} unset: expected device ordinals")
    return min(int(i) for i in ids)
