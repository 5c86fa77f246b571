"""Attention core over one mask function: `sdpa` (the dense mask, everywhere), `flex` (a `BlockMask` from the
same function; compiled on CUDA, forward-only on CPU) and `auto` (flex on CUDA, else sdpa; torch_npu has no
flex kernel). q [B, Hq, Tq, D], k/v [B, Hkv, Tk, D] (Hq a multiple of Hkv) -> [B, Hq, Tq, D]."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor

from drafters.common.masks import AttentionMask, MaskMod, TTTAttentionMask

AttnBackend = Literal["auto", "sdpa", "flex"]
BACKENDS: tuple[str, ...] = ("auto", "sdpa", "flex")


FLEX_DEVICES = ("cuda", "cpu")  # cpu: uncompiled and forward only (module docstring)
_COMPILED_FLEX_ON = {"cuda"}  # device types whose flex calls run compiled (`compiled_flex_on` adds one)


def resolve_backend(backend: str, device: torch.device) -> Literal["sdpa", "flex"]:
    if backend not in BACKENDS:
        raise ValueError(f"attn_backend: got {backend!r}, expected one of {BACKENDS}")
    if backend == "auto":
        return "flex" if device.type == "cuda" else "sdpa"
    if backend == "flex" and device.type not in FLEX_DEVICES:
        raise ValueError(f"attn_backend='flex' on device type {device.type!r}: flex attention runs on "
                         f"{' and '.join(FLEX_DEVICES)} only; expected auto or sdpa (the dense-mask path)")
    return "flex" if backend == "flex" else "sdpa"


def _masked_flex(q: Tensor, k: Tensor, v: Tensor, mask_mod: MaskMod | None, batch: int, gqa: bool) -> Tensor:
    """flex attention under `mask_mod` for `batch` rows at the tensors' own lengths; the BlockMask is
    built inside the compiled graph (one built outside would pin its lengths as Python ints)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    block_mask = None
    if mask_mod is not None:
        block_mask = create_block_mask(mask_mod, batch, None, q.shape[2], k.shape[2], device=q.device)
    out = flex_attention(q, k, v, block_mask=block_mask, enable_gqa=gqa)
    assert isinstance(out, Tensor)
    return out


@functools.cache
def _compiled_flex() -> Callable[..., Any]:
    return torch.compile(_masked_flex)


def _flex(q: Tensor, k: Tensor, v: Tensor, mask: AttentionMask | None) -> Tensor:
    """Compiled, contiguous q/k/v, lengths and captured sizes dynamic: one graph per mask function for every
    length, step, offset and block size (benchmarks/flex_compiles.py counts them)."""
    gqa = q.shape[1] != k.shape[1]
    mask_mod = None if mask is None else mask.mask_mod
    batch = q.shape[0] if mask is None else mask.batch
    if q.device.type not in _COMPILED_FLEX_ON:
        return _masked_flex(q, k, v, mask_mod, batch, gqa)
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()  # one layout: graphs are specialized to strides
    for t in (q, k, v):
        torch._dynamo.maybe_mark_dynamic(t, 2)
    for cell in getattr(mask_mod, "__closure__", None) or ():
        captured = cell.cell_contents
        if isinstance(captured, Tensor):
            for dim in range(captured.dim()):
                torch._dynamo.maybe_mark_dynamic(captured, dim)
    out: Tensor = _compiled_flex()(q, k, v, mask_mod, batch, gqa)
    return out


@contextlib.contextmanager
def compiled_flex_on(device_type: str) -> Iterator[None]:
    """While active, flex calls on `device_type` run compiled too (CUDA's always do): the compile
    count check runs CUDA's code path on CPU (benchmarks/flex_compiles.py)."""
    added = device_type not in _COMPILED_FLEX_ON
    _COMPILED_FLEX_ON.add(device_type)
    try:
        yield
    finally:
        if added:
            _COMPILED_FLEX_ON.discard(device_type)


def attend(q: Tensor, k: Tensor, v: Tensor, mask: AttentionMask | None, backend: str = "auto") -> Tensor:
    """Softmax attention of q over k/v restricted by `mask` (see module docstring for shapes)."""
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"heads: {q.shape[1]} query heads is not a multiple of {k.shape[1]} kv heads")
    if mask is not None and (mask.q_len, mask.kv_len) != (q.shape[2], k.shape[2]):
        raise ValueError(f"mask: sized for (Tq, Tk)=({mask.q_len}, {mask.kv_len}), "
                         f"tensors have ({q.shape[2]}, {k.shape[2]})")
    if resolve_backend(backend, q.device) == "flex":
        return _flex(q, k, v, mask)
    if isinstance(mask, TTTAttentionMask) and q.device.type == "cpu" and _CPU_FLASH is not None:
        return ttt_sdpa(q, k, v, mask)
    if isinstance(mask, BlockGatherMask) and q.device.type == "cpu" and _CPU_FLASH is not None:
        return block_gather_sdpa(q, k, v, mask)
    dense = None if mask is None else mask.dense(q.device)
    gqa = q.shape[1] != k.shape[1]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=dense, enable_gqa=gqa)


# ----------------------------------------------------------------------------- TTT fast path (CPU)
# At TTT step j the dense mask has (j + 1) * T keys per query but only t + 1 + j of them are
# visible: the causal step-0 block and one diagonal key per later step. SDPA over the dense mask
# costs (j + 1) * T^2 per step (sum over 7 steps: 28 T^2). Here: flash attention over the step-0
# block only (is_causal when no key is padded: T^2 / 2) plus the j diagonal scores, merged with
# the step-0 log-sum-exp: out = e^(lse0 - lse) * out0 + sum_i e^(d_i - lse) * v_i. The backward
# reuses the flash backward with the MERGED (out, lse), which gives the gradients of the full
# softmax restricted to the step-0 keys; the diagonal terms are added in closed form.
#
# The per-query keys are laid out [B, Hkv, Tq, J, D] and the queries grouped by kv head,
# [B, Hkv, Tq, G, D] (query head h = kv head h // G, as SDPA's enable_gqa), so every per-query
# product is one small batched matmul (G x D @ D x J) with no repeat of the keys over the G
# query heads. Worked example, Hq 4, Hkv 2 (G 2), J 3: query head 3 is (kv head 1, group 1); its
# scores at query t are row 1 of q[b, 1, t] (2 x D) @ kd[b, 1, t].T (D x 3).

_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_CPU_FLASH_BWD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


def _additive(mask: Tensor, dtype: torch.dtype) -> Tensor:
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


def _grouped(x: Tensor, hkv: int) -> Tensor:
    """[B, Hq, Tq, ...] -> [B, Hkv, Tq, G, ...] (a view: query head h = kv head h // G, group h % G)."""
    b, hq, tq = x.shape[:3]
    return x.view(b, hkv, hq // hkv, tq, *x.shape[3:]).transpose(2, 3)


def _ungrouped(x: Tensor) -> Tensor:
    """[B, Hkv, Tq, G, ...] -> [B, Hq, Tq, ...] (contiguous); inverse of `_grouped`."""
    b, hkv, tq, g = x.shape[:4]
    return x.transpose(2, 3).reshape(b, hkv * g, tq, *x.shape[4:])


def _slot_scores(qg: Tensor, kd: Tensor, dbias: Tensor | None, scale: float) -> Tensor:
    """Scores of the grouped queries qg [B, Hkv, Tq, G, D] over their own keys kd [B, Hkv, Tq, J, D],
    plus dbias [B, 1, Tq, J] (0 / -inf: empty slots): [B, Hkv, Tq, G, J]."""
    s = torch.matmul(qg, kd.transpose(-1, -2)) * scale
    return s if dbias is None else s + dbias[:, :, :, None, :].to(s.dtype)


class _TTTAttention(torch.autograd.Function):
    """Softmax attention of q [B, Hq, Tq, D] over flash key blocks (k, v [B, Hkv, Tk, D], mask or None,
    causal flag each) plus J own keys per query (kd/vd [B, Hkv, Tq, J, D], dbias [B, 1, Tq, J])."""

    @staticmethod
    def forward(ctx: Any, q: Tensor, kd: Tensor, vd: Tensor, dbias: Tensor | None, scale: float,
                causal: tuple[bool, ...], *tensors: Tensor | None) -> Tensor:
        assert _CPU_FLASH is not None
        outs, lses = [], []
        for i, is_causal in enumerate(causal):
            k, v, m = tensors[3 * i: 3 * i + 3]
            o, lse_b = _CPU_FLASH(q, k, v, 0.0, is_causal, attn_mask=m, scale=scale)
            outs.append(o)
            lses.append(lse_b)
        acc, hkv = lses[0].dtype, kd.shape[1]  # acc: float32 for bf16/fp16/fp32 inputs, float64 for float64
        s = _slot_scores(_grouped(q.to(acc), hkv), kd.to(acc), dbias, scale)  # [B, Hkv, Tq, G, J]
        lse_g = torch.logsumexp(torch.cat([_grouped(torch.stack(lses, -1), hkv), s], -1), -1)  # [B, Hkv, Tq, G]
        out = _ungrouped(torch.matmul(torch.exp(s - lse_g[..., None]), vd.to(acc)))  # [B, Hq, Tq, D]
        lse = _ungrouped(lse_g)  # [B, Hq, Tq]
        for o, lse_b in zip(outs, lses):
            out = out + torch.exp(lse_b - lse)[..., None] * o.to(acc)
        out = out.to(q.dtype)
        ctx.scale, ctx.causal = scale, causal
        ctx.has_bias = dbias is not None
        ctx.save_for_backward(q, kd, vd, out, lse, *((dbias,) if dbias is not None else ()), *tensors)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        assert _CPU_FLASH_BWD is not None
        q, kd, vd, out, lse, *tensors = ctx.saved_tensors
        dbias = tensors.pop(0) if ctx.has_bias else None
        scale = ctx.scale
        grad = grad.contiguous()
        acc, hkv = lse.dtype, kd.shape[1]
        k32, v32 = kd.to(acc), vd.to(acc)
        qg, gg = _grouped(q.to(acc), hkv), _grouped(grad.to(acc), hkv)  # [B, Hkv, Tq, G, D]
        w = torch.exp(_slot_scores(qg, k32, dbias, scale) - _grouped(lse, hkv)[..., None])  # [B, Hkv, Tq, G, J]
        delta = (gg * _grouped(out.to(acc), hkv)).sum(-1)  # [B, Hkv, Tq, G]
        ds = w * (torch.matmul(gg, v32.transpose(-1, -2)) - delta[..., None])  # [B, Hkv, Tq, G, J]
        gq = _ungrouped(torch.matmul(ds, k32)) * scale  # [B, Hq, Tq, D]
        gkd = (torch.matmul(ds.transpose(-1, -2), qg) * scale).to(kd.dtype)  # [B, Hkv, Tq, J, D]
        gvd = torch.matmul(w.transpose(-1, -2), gg).to(vd.dtype)
        block_grads: list[Tensor | None] = []
        for i, is_causal in enumerate(ctx.causal):
            k, v, m = tensors[3 * i: 3 * i + 3]
            # flash backward with the MERGED (out, lse): gradients of the full softmax on this block
            gq_b, gk, gv = _CPU_FLASH_BWD(grad, q, k, v, out, lse, 0.0, is_causal, attn_mask=m, scale=scale)
            gq = gq + gq_b.to(acc)
            block_grads += [gk, gv, None]
        return (gq.to(q.dtype), gkd, gvd, None, None, None, *block_grads)


def ttt_sdpa(q: Tensor, k: Tensor, v: Tensor, mask: TTTAttentionMask) -> Tensor:
    """Same result as SDPA over `mask.dense()` (forward and backward) without the dense keys: step 0
    as flash blocks, steps 1..j as diagonals."""
    t, lo, steps = mask.key_valid.shape[1], mask.q_offset, mask.step
    if k.shape[2] != (steps + 1) * t:
        raise ValueError(f"keys: {k.shape[2]}, expected (step + 1) * T = {(steps + 1) * t}")
    kd = k[:, :, t:].unflatten(2, (steps, t))[:, :, :, lo:].transpose(2, 3)  # [B, Hkv, Tq, steps, D]
    vd = v[:, :, t:].unflatten(2, (steps, t))[:, :, :, lo:].transpose(2, 3)
    k0, v0 = k[:, :, :t], v[:, :, :t]
    blocks: list[tuple[Tensor, Tensor, Tensor | None, bool]] = []
    if bool(mask.key_valid.all()):
        if lo:
            blocks.append((k0[:, :, :lo], v0[:, :, :lo], None, False))
        blocks.append((k0[:, :, lo:], v0[:, :, lo:], None, True))
    else:
        blocks.append((k0, v0, _additive(mask.step0_dense(q.device), q.dtype), False))
    tensors: list[Tensor | None] = []
    for bk, bv, bm, _ in blocks:
        tensors += [bk.contiguous(), bv.contiguous(), bm]
    out: Tensor = _TTTAttention.apply(q.contiguous(), kd, vd, None, q.shape[-1] ** -0.5,
                                      tuple(b[3] for b in blocks), *tensors)
    return out


# ------------------------------------------------------- block + gathered keys fast path (CPU)
# P-EAGLE's COD mask (drafters/peagle/cod.py): every query sees a subset of the first `block_len`
# keys (the depth-0 elements) plus at most J keys of its own chain. SDPA over the dense mask costs
# Tq * Tk; here flash attention over the block (with its dense mask) plus J gathered scores per
# query, merged by log-sum-exp as above (`_TTTAttention` with a 0 / -inf bias on the slots).


@dataclass
class BlockGatherMask(AttentionMask):
    """A mask function with its structure: key kv < block_len is visible iff block_mask[b, 0, q, kv]
    (bool [B, 1, Tq, block_len]), a later key iff it is in gather_index[b, q, :] (int64 [B, Tq, J],
    -1 = empty); `dense()` still evaluates `mask_mod`, and tests prove the two agree."""

    block_mask: Tensor
    gather_index: Tensor

    @property
    def block_len(self) -> int:
        return int(self.block_mask.shape[-1])


def block_gather_sdpa(q: Tensor, k: Tensor, v: Tensor, mask: BlockGatherMask) -> Tensor:
    """Same result as SDPA over `mask.dense()` (forward and backward) without the dense keys."""
    n = mask.block_len
    idx = mask.gather_index  # [B, Tq, J]
    b, tq, j = idx.shape
    safe = idx.clamp(min=0)
    hkv, dim = k.shape[1], k.shape[-1]
    flat = safe.reshape(b, 1, tq * j, 1).expand(b, hkv, tq * j, dim)
    kd = torch.gather(k, 2, flat).view(b, hkv, tq, j, dim)  # [B, Hkv, Tq, J, D]
    vd = torch.gather(v, 2, flat).view(b, hkv, tq, j, dim)
    dbias = _additive(idx[:, None] >= 0, torch.float32)  # [B, 1, Tq, J]
    block = _additive(mask.block_mask, q.dtype)
    out: Tensor = _TTTAttention.apply(q.contiguous(), kd, vd, dbias, q.shape[-1] ** -0.5, (False,),
                                      k[:, :, :n].contiguous(), v[:, :, :n].contiguous(), block)
    return out
