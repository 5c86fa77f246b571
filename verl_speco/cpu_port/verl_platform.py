"""verl's CPU platform, shipped by verl-speco: `PlatformCPU`, registered as verl platform `"cpu"`.

Loaded through verl's plugin hook (`VERL_USE_EXTERNAL_MODULES=verl_speco.cpu_port.verl_platform`)
and selected by `VERL_PLATFORM=cpu` (never auto-detected, so a machine with an accelerator keeps
verl's own platform); `env.cpu_environment()` sets both. Besides the platform members, verl needs the
backend string it builds deduplicated (`init_process_group` wrapped), `verl_device` as the device
module, `current_device()` the string "cpu" and `ray_resource_name()` "GPU" (why:
docs/design/verl-on-cpu.md section 1). tests/verl/test_cpu_platform.py pins the verl symbols used."""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
from types import ModuleType
from typing import Any

import torch
import torch.distributed
from verl.plugin.platform.platform_base import PlatformBase
from verl.plugin.platform.platform_manager import PlatformRegistry

from verl_speco.cpu_port import verl_device

PLATFORM_NAME = "cpu"


def selected() -> bool:
    """True when verl is told to use this platform (`VERL_PLATFORM=cpu`)."""
    return os.environ.get("VERL_PLATFORM", "").strip().lower() == PLATFORM_NAME


@PlatformRegistry.register(platform=PLATFORM_NAME)
class PlatformCPU(PlatformBase):
    """verl on host CPUs: gloo collectives, shared-memory weight sync, no IPC handles."""

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> ModuleType:
        return verl_device

    def is_available(self) -> bool:
        return True

    def is_platform_available(self, use_smi_check: bool = False) -> bool:
        return selected()  # explicit only: auto-detection must never pick the CPU over an accelerator

    def current_device(self) -> Any:  # verl: `.to(get_device_id())`; "cpu", never an int (= cuda:N)
        return "cpu"

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: Any) -> None:
        return None

    def synchronize(self, device_index: int | None = None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
        return (None, None)

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"  # Ray sets it for the fake GPU; CPU torch ignores it

    @contextlib.contextmanager
    def nvtx_range(self, msg: str) -> Iterator[None]:
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def ray_resource_name(self) -> str:
        return "GPU"

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False  # weight buckets go through multiprocessing.shared_memory

    def rollout_env_vars(self) -> dict[str, str]:
        keep = ("VLLM_CPU_", "OMP_NUM_THREADS")
        return {k: v for k, v in os.environ.items() if k.startswith(keep)}

    def cudart(self) -> Any:
        return None


def collapse_backend(backend: Any) -> Any:
    """`"cpu:gloo,cpu:gloo"` -> `"cpu:gloo"`: one entry per device type (the first wins).

    Anything else (None, a plain backend name, distinct device types) is returned unchanged; two
    different backends for one device type raise, naming both."""
    if not isinstance(backend, str) or "," not in backend or ":" not in backend:
        return backend
    seen: dict[str, str] = {}
    for entry in (e.strip() for e in backend.split(",") if e.strip()):
        device, _, name = entry.partition(":")
        if device in seen and seen[device] != name:
            raise ValueError(f"init_process_group backend {backend!r}: device type {device!r} has two "
                             f"backends ({seen[device]!r} and {name!r}); expected one")
        seen.setdefault(device, name)
    return ",".join(f"{d}:{n}" for d, n in seen.items())


def install_process_group_fix() -> bool:
    """Wrap `torch.distributed.init_process_group` with `collapse_backend` (once); True if installed now."""
    original = torch.distributed.init_process_group
    if getattr(original, "_speco_cpu_wrapped", False):
        return False

    @functools.wraps(original)
    def init_process_group(*args: Any, **kwargs: Any) -> Any:
        if "backend" in kwargs:
            kwargs["backend"] = collapse_backend(kwargs["backend"])
        elif args:
            args = (collapse_backend(args[0]), *args[1:])
        return original(*args, **kwargs)

    init_process_group._speco_cpu_wrapped = True  # type: ignore[attr-defined]
    torch.distributed.init_process_group = init_process_group
    return True


if selected():  # what `install_cpu_port(verl=True)` does: verl's plugin hook imports this module
    install_process_group_fix()
