"""Attention instruments of scripts/gpu_check.py: the masks a training step builds, its model FLOPs,
and the proof that flex attention's block masks equal the dense masks.

- `record_masks()`: while active, every drafter attention call (`drafters.common.layers.attend`,
  `drafters.dflash.model.attend`, the two call sites of `drafters.common.attention.attend`) is
  recorded (mask, query shape) and answered with the query itself: no attention FLOPs, the same
  shapes, so a step under torch's FlopCounterMode counts the model's other FLOPs exactly.
- `attention_flops(calls)`: the attention FLOPs of a training step over the recorded calls: per call
  forward 4 * D * Hq * (visible query-key pairs), backward twice that (model FLOPs: masked pairs
  are not counted, whatever a kernel computes).
- `check_mask(mask, device)`: on `device`, (1) flex's `create_mask` of the mask function equals
  `AttentionMask.dense()` element for element; (2) the `BlockMask` of `create_block_mask` lists
  exactly the 128 x 128 blocks holding a visible pair, and every block it marks full is all
  visible; (3) flex attention under that BlockMask equals SDPA under the dense mask on random
  float32 inputs (rows with a visible key).
- `compare_flex_to_dense()`: while active, every flex call of a training step (bf16, the compiled
  kernel on CUDA) is compared with float32 SDPA over the dense mask of the same inputs.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import torch
import torch.nn.functional as F
from torch import Tensor

import drafters.common.attention as attention_module
from drafters.common.masks import AttentionMask

CALL_SITES = ("drafters.common.layers.attend", "drafters.dflash.model.attend")
FLEX_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}  # relative (_max_diff)


@dataclass
class Recorded:
    calls: list[tuple[AttentionMask | None, tuple[int, ...]]] = field(default_factory=list)

    def masks(self) -> list[AttentionMask]:
        """The distinct masks (a mask shared by several layers counts once)."""
        seen: dict[int, AttentionMask] = {}
        for mask, _ in self.calls:
            if mask is not None:
                seen.setdefault(id(mask), mask)
        return list(seen.values())


@contextlib.contextmanager
def record_masks() -> Iterator[Recorded]:
    rec = Recorded()

    def stand_in(q: Tensor, k: Tensor, v: Tensor, mask: AttentionMask | None, backend: str = "auto") -> Tensor:
        rec.calls.append((mask, tuple(q.shape)))
        return q

    with contextlib.ExitStack() as stack:
        for site in CALL_SITES:
            stack.enter_context(mock.patch(site, stand_in))
        yield rec


def attention_flops(rec: Recorded, device: torch.device) -> float:
    total = 0.0
    visible: dict[int, float] = {}
    for mask, (b, hq, tq, d) in rec.calls:
        if mask is None:
            pairs = float(b * tq * tq)
        else:
            if id(mask) not in visible:
                visible[id(mask)] = float(mask.dense(device).sum())
            pairs = visible[id(mask)]
        total += 3 * 4 * d * hq * pairs
    return total


@dataclass
class MaskCheck:
    shape: tuple[int, int, int]  # (B, Tq, Tk)
    elementwise: bool
    blocks: bool
    outputs: bool
    max_diff: float

    @property
    def ok(self) -> bool:
        return self.elementwise and self.blocks and self.outputs


def _listed(num: Tensor | None, idx: Tensor | None, nkb: int) -> Tensor | None:
    """BlockMask (kv_num_blocks [B, H, nQB], kv_indices [B, H, nQB, K]) -> bool [B, H, nQB, nKB]."""
    if num is None or idx is None:
        return None
    take = torch.arange(idx.shape[-1], device=idx.device) < num[..., None]
    out = torch.zeros(*idx.shape[:-1], nkb + 1, dtype=torch.bool, device=idx.device)
    out.scatter_(-1, torch.where(take, idx.long(), nkb), True)
    return out[..., :nkb]


def _pooled(dense: Tensor, block: tuple[int, int], reduce: Callable[..., Tensor]) -> Tensor:
    b, h, tq, tk = dense.shape
    nqb, nkb = -(-tq // block[0]), -(-tk // block[1])
    padded = torch.zeros(b, h, nqb * block[0], nkb * block[1], dtype=torch.bool, device=dense.device)
    padded[..., :tq, :tk] = dense
    if reduce is torch.all:  # padding is not visible but does not make a full block partial
        padded[..., tq:, :] = True
        padded[..., :, tk:] = True
    return reduce(reduce(padded.view(b, h, nqb, block[0], nkb, block[1]), dim=5), dim=3)


def check_mask(mask: AttentionMask, device: torch.device, seed: int = 0) -> MaskCheck:
    from torch.nn.attention.flex_attention import create_block_mask, create_mask, flex_attention

    dense = mask.dense(device)
    elem = create_mask(mask.mask_mod, mask.batch, None, mask.q_len, mask.kv_len, device=str(device))
    elementwise = bool(torch.equal(elem.to(torch.bool), dense))
    bm = create_block_mask(mask.mask_mod, mask.batch, None, mask.q_len, mask.kv_len, device=str(device))
    block = tuple(bm.BLOCK_SIZE)
    assert len(block) == 2
    nkb = -(-mask.kv_len // block[1])
    partial, full = _listed(bm.kv_num_blocks, bm.kv_indices, nkb), _listed(bm.full_kv_num_blocks, bm.full_kv_indices, nkb)
    assert partial is not None
    listed = partial if full is None else partial | full
    blocks = bool(torch.equal(listed, _pooled(dense, (block[0], block[1]), torch.any)))
    if full is not None:
        blocks = blocks and bool((~full | _pooled(dense, (block[0], block[1]), torch.all)).all())
    g = torch.Generator(device=device).manual_seed(seed)
    q = torch.randn(mask.batch, 2, mask.q_len, 16, generator=g, device=device)
    k, v = (torch.randn(mask.batch, 1, mask.kv_len, 16, generator=g, device=device) for _ in range(2))
    out = flex_attention(q, k, v, block_mask=bm, enable_gqa=True)
    assert isinstance(out, Tensor)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=dense, enable_gqa=True)
    diff = _max_diff(out, ref, dense)
    return MaskCheck((mask.batch, mask.q_len, mask.kv_len), elementwise, blocks,
                     diff <= FLEX_TOLERANCE[torch.float32], diff)


def _max_diff(out: Tensor, ref: Tensor, dense: Tensor) -> float:
    """max |out - ref| over rows with a visible key (SDPA gives NaN on an empty row, flex 0), relative
    to max(1, max |ref|) there."""
    rows = dense.any(-1, keepdim=True)  # [B, 1, Tq, 1]
    scale = max(1.0, float(torch.where(rows, ref.float().abs(), 0.0).max()))
    return float(torch.where(rows, (out.float() - ref.float()).abs(), 0.0).max()) / scale


@dataclass
class FlexComparison:
    calls: int = 0
    dtypes: set[str] = field(default_factory=set)
    max_diff: float = 0.0
    failures: int = 0


@contextlib.contextmanager
def compare_flex_to_dense() -> Iterator[FlexComparison]:
    stats = FlexComparison()
    original: Any = attention_module._flex

    def checked(q: Tensor, k: Tensor, v: Tensor, mask: AttentionMask | None) -> Tensor:
        out: Tensor = original(q, k, v, mask)
        with torch.no_grad():
            dense = mask.dense(q.device) if mask is not None else torch.ones(
                q.shape[0], 1, q.shape[2], k.shape[2], dtype=torch.bool, device=q.device)
            group = q.shape[1] // k.shape[1]  # keys repeated per query head: a kernel that takes a mask
            ref = F.scaled_dot_product_attention(q.float(), k.float().repeat_interleave(group, 1),
                                                 v.float().repeat_interleave(group, 1), attn_mask=dense)
            diff = _max_diff(out, ref, dense)
        stats.calls += 1
        stats.dtypes.add(str(q.dtype).removeprefix("torch."))
        stats.max_diff = max(stats.max_diff, diff)
        stats.failures += int(diff > FLEX_TOLERANCE.get(q.dtype, 2e-2))
        return out

    with mock.patch.object(attention_module, "_flex", checked):
        yield stats
