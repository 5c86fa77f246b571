"""The device module of verl's CPU platform (`PlatformCPU.device_module`, i.e. `get_torch_device()`).

verl calls `get_torch_device().<name>` with the `torch.cuda` vocabulary; `torch.cpu` has only part
of it (`Event`, `Stream`, `current_device`, `current_stream`, `device_count`, `is_available`,
`set_device`, `stream`, `synchronize`). This module re-exports those and adds the rest verl uses:
cache and memory-fraction calls are no-ops, memory statistics are 0 (the host allocator keeps no
such counters), `mem_get_info` is the host's (free, total) RAM, the RNG state is torch's CPU one.
tests/verl/test_cpu_platform.py checks that every `get_torch_device().X` in verl's source exists here."""

from __future__ import annotations

import os
from typing import Any

import torch
from torch.cpu import (  # noqa: F401 - re-exported: verl calls them through get_torch_device()
    Event,
    Stream,
    current_device,
    current_stream,
    stream,
    synchronize,
)


def is_available() -> bool:
    return True


def device_count() -> int:
    return 1


def set_device(device: Any) -> None:
    return None


def get_device_name(device: Any = None) -> str:
    return "cpu"


def empty_cache() -> None:
    return None


def ipc_collect() -> None:
    return None


def set_per_process_memory_fraction(fraction: float, device: Any = None) -> None:
    return None


def manual_seed(seed: int) -> None:
    torch.manual_seed(seed)


def manual_seed_all(seed: int) -> None:
    torch.manual_seed(seed)


def get_rng_state(device: Any = None) -> torch.Tensor:
    return torch.get_rng_state()


def set_rng_state(state: torch.Tensor, device: Any = None) -> None:
    torch.set_rng_state(state)


def memory_allocated(device: Any = None) -> int:
    return 0


def memory_reserved(device: Any = None) -> int:
    return 0


def max_memory_allocated(device: Any = None) -> int:
    return 0


def max_memory_reserved(device: Any = None) -> int:
    return 0


def reset_peak_memory_stats(device: Any = None) -> None:
    return None


def mem_get_info(device: Any = None) -> tuple[int, int]:
    """(available, total) host RAM in bytes."""
    try:
        import psutil

        vm = psutil.virtual_memory()
        return int(vm.available), int(vm.total)
    except ImportError:
        pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
        avail = os.sysconf("SC_AVPHYS_PAGES")
        return int(avail * size), int(pages * size)
