"""verl's CPU platform, shipped by verl-speco: `PlatformCPU`, registered as verl platform `"cpu"`.

Loaded through verl's own plugin hook: `VERL_USE_EXTERNAL_MODULES=verl_speco.cpu_port.verl_platform`
makes `import verl` import this module (`verl/__init__.py`, before anything resolves the platform
singleton), and `VERL_PLATFORM=cpu` selects it. It is never auto-detected: `is_platform_available`
is True only under `VERL_PLATFORM=cpu`, so a machine with an accelerator keeps verl's own platform.
`env.cpu_environment()` sets both variables (plus the rest of the CPU recipe) for a run.

What verl needs besides the platform members (docs/design/verl-on-cpu.md section 1):
- `torch.distributed.init_process_group` is wrapped (only when this platform is selected) so the
  backend string verl builds, `f"cpu:gloo,{device}:{backend}"` = "cpu:gloo,cpu:gloo", keeps one
  entry per device type (torch rejects the duplicate: "Duplicate device type cpu in backend string").
- `device_module` is `verl_device`, a module with the `torch.cuda`-like calls verl makes.
- `current_device()` is the string "cpu": verl moves tensors with `.to(get_device_id())`, where an
  int 0 would mean cuda:0.
- `ray_resource_name()` is "GPU": verl's resource-pool check counts only GPU/NPU, so the run starts
  Ray with a fake GPU count (`ray_kwargs.ray_init.num_gpus`); CPU torch ignores CUDA_VISIBLE_DEVICES.
tests/verl/test_cpu_platform.py pins every verl symbol this relies on.
"""

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

from verl_speco.cpu_port import install_cpu_port, verl_device

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


install_cpu_port(vllm=False, verl=True)  # the process-group fix, when this platform is selected
