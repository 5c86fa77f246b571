"""Attention masks as mask functions (one definition serves SDPA through `AttentionMask.dense()` and flex
attention; captured sizes are tensors, so one flex graph serves every offset) and the left shift.
EAGLE-3 TTT mask: at step j the keys are steps 0..j, T each; row t sees the real step-0 keys s <= t and
the step-i keys at s == t (its own position, so a padded row is never empty). T = 4, j = 2::

            step-0 keys   step-1 keys   step-2 keys
    row 0:   1 0 0 0       1 0 0 0       1 0 0 0
    row 1:   1 1 0 0       0 1 0 0       0 1 0 0
    row 2:   1 1 1 0       0 0 1 0       0 0 1 0
    row 3:   1 1 1 1       0 0 0 1       0 0 0 1"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


@dataclass
class AttentionMask:
    """A mask function plus the sizes it is evaluated at: batch B, query length Tq, key length Tk."""

    mask_mod: MaskMod
    batch: int
    q_len: int
    kv_len: int

    def dense(self, device: torch.device | str = "cpu") -> Tensor:
        """Evaluate the mask function by broadcasting: bool [B, 1, Tq, Tk]."""
        b = torch.arange(self.batch, device=device).view(-1, 1, 1, 1)
        h = torch.zeros(1, device=device, dtype=torch.long).view(1, 1, 1, 1)
        q = torch.arange(self.q_len, device=device).view(1, 1, -1, 1)
        kv = torch.arange(self.kv_len, device=device).view(1, 1, 1, -1)
        out = self.mask_mod(b, h, q, kv)
        return out.expand(self.batch, 1, self.q_len, self.kv_len).to(torch.bool)


def int_scalar(value: int, like: Tensor) -> Tensor:
    """`value` as a 0-d int64 tensor on `like`'s device for a mask function to capture: a tensor is an
    input of a compiled flex graph, a Python int a constant it would be recompiled for."""
    return torch.full((), value, dtype=torch.int64, device=like.device)


def dense_attention_mask(mask: Tensor, batch: int = 1) -> AttentionMask:
    """A precomputed bool mask [Tq, Tk] (True = may attend) as an `AttentionMask` for `batch` rows."""
    if mask.dim() != 2:
        raise ValueError(f"mask: got shape {tuple(mask.shape)}, expected [Tq, Tk]")
    table = mask.to(torch.bool)

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        return table.to(q_idx.device)[q_idx, kv_idx]

    return AttentionMask(mask_mod, batch, table.shape[0], table.shape[1])


def ttt_mask_mod(key_valid: Tensor, q_offset: int = 0) -> MaskMod:
    """TTT mask function for keys laid out step-major (kv = step * T + s); key_valid: bool [B, T];
    query row q_idx stands for position q_idx + q_offset (steps that compute only the later rows)."""
    valid = key_valid.to(torch.bool)
    seq_len, offset = int_scalar(key_valid.shape[1], valid), int_scalar(q_offset, valid)

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        q_pos = q_idx + offset
        step = kv_idx // seq_len
        pos = kv_idx % seq_len
        causal_step0 = (step == 0) & (pos <= q_pos) & valid[b, pos]
        return causal_step0 | (pos == q_pos)

    return mask_mod


@dataclass
class TTTAttentionMask(AttentionMask):
    """The TTT mask plus its structure (step-0 block + j diagonal blocks), so SDPA can skip the mostly
    masked keys; queries are rows q_offset..T-1."""

    key_valid: Tensor
    step: int
    q_offset: int

    def step0_dense(self, device: torch.device | str = "cpu") -> Tensor:
        """bool [B, 1, Tq, T]: the step-0 key block of `dense()` (causal over real keys, plus the diagonal)."""
        return AttentionMask(self.mask_mod, self.batch, self.q_len, self.key_valid.shape[1]).dense(device)


def ttt_attention_mask(key_valid: Tensor, step: int, q_offset: int = 0) -> TTTAttentionMask:
    """Mask for TTT step `step` (0-based; step 0 is plain causal with padded keys hidden): queries
    (rows q_offset..T-1 of [B, T]) against (step + 1) * T keys."""
    if step < 0:
        raise ValueError(f"step: got {step}, expected >= 0")
    batch, seq_len = key_valid.shape
    if not 0 <= q_offset < seq_len:
        raise ValueError(f"q_offset: got {q_offset}, expected 0..{seq_len - 1}")
    valid = key_valid.to(torch.bool)
    return TTTAttentionMask(ttt_mask_mod(valid, q_offset), batch, seq_len - q_offset, (step + 1) * seq_len,
                            valid, step, q_offset)


def ttt_position_ids(position_ids: Tensor, step: int) -> Tensor:
    """RoPE positions at TTT step j: the step-0 positions + j ([B, T] -> [B, T]), as draft step j sits
    at position n + j at inference (SafeAILab `position_ids + lck`)."""
    return position_ids + step


def shift_left(x: Tensor, n: int, fill: float | int | bool = 0) -> Tensor:
    """Shift dim 1 left by n, filling the last n with `fill`: shift_left([[a, b, c, d]], 1) = [[b, c, d, 0]]."""
    if n < 0:
        raise ValueError(f"n: got {n}, expected >= 0")
    if n == 0:
        return x
    tail = torch.full_like(x[:, :n], fill) if n <= x.shape[1] else torch.full_like(x, fill)
    if n >= x.shape[1]:
        return tail
    return torch.cat([x[:, n:], tail], dim=1)
