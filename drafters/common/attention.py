"""Attention core with two backends over one mask function.

- `sdpa`: `scaled_dot_product_attention` with the dense bool mask from `AttentionMask.dense()`.
  Runs everywhere, forward and backward (CPU training uses it).
- `flex`: flex attention with a `BlockMask` built by `create_block_mask` from the same mask
  function. Compiled on CUDA; on CPU it runs eagerly, forward only (its backward is not
  implemented on CPU in torch 2.13), which is enough for the agreement test.
- `auto`: flex on CUDA, sdpa elsewhere.

Shapes: q [B, Hq, Tq, D], k/v [B, Hkv, Tk, D] with Hq a multiple of Hkv (grouped-query attention);
output [B, Hq, Tq, D]. `mask=None` means every query sees every key.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from drafters.common.masks import AttentionMask

AttnBackend = Literal["auto", "sdpa", "flex"]
BACKENDS: tuple[str, ...] = ("auto", "sdpa", "flex")


def resolve_backend(backend: str, device: torch.device) -> Literal["sdpa", "flex"]:
    if backend not in BACKENDS:
        raise ValueError(f"attn_backend: got {backend!r}, expected one of {BACKENDS}")
    if backend == "auto":
        return "flex" if device.type == "cuda" else "sdpa"
    return "flex" if backend == "flex" else "sdpa"


@functools.cache
def _compiled_flex() -> Callable[..., Any]:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)  # recompiles once per new shape kind, then dynamic


def _flex(q: Tensor, k: Tensor, v: Tensor, mask: AttentionMask | None) -> Tensor:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    block_mask = None
    if mask is not None:
        block_mask = create_block_mask(mask.mask_mod, mask.batch, None, mask.q_len, mask.kv_len,
                                       device=str(q.device))
    fn: Callable[..., Any] = _compiled_flex() if q.is_cuda else flex_attention  # type: ignore[assignment]
    gqa = q.shape[1] != k.shape[1]
    out = fn(q, k, v, block_mask=block_mask, enable_gqa=gqa)
    assert isinstance(out, Tensor)
    return out


def attend(q: Tensor, k: Tensor, v: Tensor, mask: AttentionMask | None, backend: str = "auto") -> Tensor:
    """Softmax attention of q over k/v restricted by `mask` (see module docstring for shapes)."""
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"heads: {q.shape[1]} query heads is not a multiple of {k.shape[1]} kv heads")
    if mask is not None and (mask.q_len, mask.kv_len) != (q.shape[2], k.shape[2]):
        raise ValueError(f"mask: sized for (Tq, Tk)=({mask.q_len}, {mask.kv_len}), "
                         f"tensors have ({q.shape[2]}, {k.shape[2]})")
    if resolve_backend(backend, q.device) == "flex":
        return _flex(q, k, v, mask)
    dense = None if mask is None else mask.dense(q.device)
    gqa = q.shape[1] != k.shape[1]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=dense, enable_gqa=gqa)
