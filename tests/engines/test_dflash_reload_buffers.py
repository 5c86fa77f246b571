"""`_rebuild_dflash_buffers` (the DFlash context K/V buffers rebuilt after an in-place draft reload):
the fused projection equals the published k/v rows stacked layer by layer, in the installed
weights' dtype and ON THEIR DEVICE. The held copy of a publish lives in host memory; a fused weight
left there would make the first draft step after a publish on GPU or NPU fail with a device
mismatch (the installed weights here sit on the meta device, so a host tensor is caught on CPU)."""

from __future__ import annotations

import torch
from torch import nn

from verl_speco.engines.vllm_reload import _rebuild_dflash_buffers


class _Attn(nn.Module):
    def __init__(self, device: str) -> None:
        super().__init__()
        self.k_norm = nn.RMSNorm(4, device=device)


class _Layer(nn.Module):
    def __init__(self, device: str) -> None:
        super().__init__()
        self.self_attn = _Attn(device)


class _Inner(nn.Module):
    """The attributes of vLLM's DFlashQwen3Model the rebuild reads."""

    def __init__(self, device: str, dtype: torch.dtype) -> None:
        super().__init__()
        self.hidden_norm = nn.RMSNorm(6, device=device, dtype=dtype)
        self.layers = nn.ModuleList([_Layer(device) for _ in range(2)])

    def _build_fused_kv_buffers(self) -> None:  # present on vLLM's DFlash model: marks it as one
        raise AssertionError("the rebuild must not call vLLM's builder (it reads repacked storage)")


class _Outer(nn.Module):
    def __init__(self, inner: _Inner) -> None:
        super().__init__()
        self.model = inner


def _buckets() -> tuple[list[list[tuple[str, torch.Tensor]]], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    bucket, rows = [], []
    for i in range(2):
        k, v = torch.randn(4, 6, generator=g, dtype=torch.float64), torch.randn(4, 6, generator=g, dtype=torch.float64)
        bucket += [(f"model.layers.{i}.self_attn.k_proj.weight", k), (f"layers.{i}.self_attn.v_proj.weight", v)]
        rows += [k, v]
    return [bucket[:2], bucket[2:]], rows


def test_fused_rows_are_the_published_k_v_rows_in_the_installed_dtype() -> None:
    inner = _Inner("cpu", torch.float32)
    buckets, rows = _buckets()
    _rebuild_dflash_buffers(_Outer(inner), buckets)
    want = torch.cat(rows).to(torch.float32)  # layer 0 k, layer 0 v, layer 1 k, layer 1 v
    assert inner._fused_kv_weight.dtype == torch.float32 and torch.equal(inner._fused_kv_weight, want)
    assert inner._fused_kv_bias is None
    assert inner._k_norm_weights.shape == (2, 4)


def test_fused_buffers_land_on_the_installed_weights_device() -> None:
    inner = _Inner("meta", torch.bfloat16)
    buckets, _ = _buckets()  # host tensors, as the reload holds them
    _rebuild_dflash_buffers(_Outer(inner), buckets)
    assert inner._fused_kv_weight.device.type == "meta" and inner._fused_kv_weight.dtype == torch.bfloat16
    assert inner._fused_kv_weight.shape == (16, 6)
