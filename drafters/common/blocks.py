"""Numerics for block drafting (DFlash, DSpark, Domino; docs/design/algorithms.md sections 4-6).
The context (positions 0..n-1) then `num_blocks` blocks of B rows, block-major, block b at positions
a_b .. a_b + B - 1; keys are [context ; all blocks]. A block sees the context before its anchor and its own
block (non-causal), never another; a padding block only itself. Worked example, ctx_len 6, B 3, anchors (1, 3)::

                 context      block 0   block 1
    rows 0-2:   1 0 0 0 0 0    1 1 1     0 0 0      (a_0 = 1: context position 0 only)
    rows 3-5:   1 1 1 0 0 0    0 0 0     1 1 1      (a_1 = 3: context positions 0, 1, 2)"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from drafters.common.masks import AttentionMask, MaskMod, int_scalar


def sample_anchors(valid_mask: Tensor, block_size: int, num_anchors: int,
                   generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
    """Per sequence, `num_anchors` block starts a (valid_mask[a], a + block_size <= length) drawn without
    replacement from `generator`: anchors int64 [batch, nb] (increasing) and anchor_valid bool [batch, nb],
    nb = min(num_anchors, largest candidate count) >= 1; short rows padded with (0, False)."""
    if valid_mask.dim() != 2:
        raise ValueError(f"valid_mask: got shape {tuple(valid_mask.shape)}, expected [batch, seq]")
    if block_size < 1:
        raise ValueError(f"block_size: got {block_size}, expected >= 1")
    if num_anchors < 1:
        raise ValueError(f"num_anchors: got {num_anchors}, expected >= 1")
    valid = valid_mask.to(torch.bool)
    batch, seq = valid.shape
    pos = torch.arange(seq, device=valid.device)
    length = torch.where(valid, pos + 1, torch.zeros_like(pos)).amax(1, keepdim=True) if seq else \
        torch.zeros(batch, 1, dtype=torch.long, device=valid.device)  # [batch, 1]
    candidate = valid & (pos[None, :] + block_size <= length)  # [batch, seq]
    device = generator.device if generator is not None else valid.device
    keys = torch.rand(batch, seq, generator=generator, device=device).to(valid.device)  # uniform in [0, 1)
    keys = torch.where(candidate, keys, torch.full_like(keys, -1.0))
    nb = max(1, min(num_anchors, int(candidate.sum(1).max()) if batch else 0))
    k = min(nb, seq)
    top = keys.topk(k, dim=1)  # the k largest keys: a uniform random subset of the candidates
    chosen, chosen_valid = top.indices, top.values >= 0
    order = torch.where(chosen_valid, chosen, chosen + seq).argsort(dim=1)  # valid anchors first, ascending
    chosen, chosen_valid = chosen.gather(1, order), chosen_valid.gather(1, order)
    anchors = torch.zeros(batch, nb, dtype=torch.long, device=valid.device)
    anchor_valid = torch.zeros(batch, nb, dtype=torch.bool, device=valid.device)
    anchors[:, :k] = torch.where(chosen_valid, chosen, torch.zeros_like(chosen))
    anchor_valid[:, :k] = chosen_valid
    return anchors, anchor_valid


def block_position_ids(anchors: Tensor, block_size: int) -> Tensor:
    """RoPE positions of the flattened blocks: anchors [batch, nb] -> [batch, nb * block_size].
    Worked example: anchors [[1, 3]], block_size 3 -> [[1, 2, 3, 3, 4, 5]]."""
    offsets = torch.arange(block_size, device=anchors.device)
    return (anchors.long()[:, :, None] + offsets).flatten(1)


def context_position_ids(batch: int, ctx_len: int, device: torch.device | str = "cpu") -> Tensor:
    """RoPE positions of the context: [batch, ctx_len] = 0..ctx_len-1 per row."""
    return torch.arange(ctx_len, device=device).expand(batch, ctx_len)


def block_input_ids(input_ids: Tensor, anchors: Tensor, block_size: int, mask_token_id: int) -> Tensor:
    """Block input tokens [batch, nb, block_size]: [x_{a_b}, MASK x (B - 1)] per block (padding anchors read
    position 0). Worked example: [[5, 6, 7, 8]], anchors [[1, 2]], B 3, mask 9 -> [[[6, 9, 9], [7, 9, 9]]]."""
    first = input_ids.long().gather(1, anchors.long())  # [batch, nb]
    out = torch.full((*anchors.shape, block_size), mask_token_id, dtype=torch.long, device=input_ids.device)
    out[:, :, 0] = first
    return out


def block_labels(input_ids: Tensor, anchors: Tensor, block_size: int) -> Tensor:
    """Tokens at the block positions [batch, nb, block_size]: slot k holds x_{a_b + k} (0 past the end).
    Worked example: input_ids [[5, 6, 7, 8]], anchors [[1, 2]], B 3 -> [[[6, 7, 8], [7, 8, 0]]]."""
    seq = input_ids.shape[1]
    pos = block_position_ids(anchors, block_size).view(*anchors.shape, block_size)
    inside = pos < seq
    tok = input_ids.long().gather(1, pos.clamp(max=seq - 1).flatten(1)).view_as(pos)
    return torch.where(inside, tok, torch.zeros_like(tok))


def next_token_anchor_candidates(valid: Tensor) -> Tensor:
    """bool [batch, seq]: anchors of the "anchor predicts the first token" layout (DSpark, Domino):
    a with valid[a] and valid[a + 1]. Worked example: [[0, 1, 1, 1, 0, 1]] -> [[0, 1, 1, 0, 0, 0]]."""
    nxt = torch.zeros_like(valid)
    nxt[:, :-1] = valid[:, 1:]
    return valid & nxt


def next_token_prefix_mask(valid: Tensor, anchors: Tensor, anchor_valid: Tensor, block_size: int) -> Tensor:
    """bool [batch, nb, B]: slot k (label x_{a+k+1}) counts iff labels a + 1 .. a + k + 1 are all
    valid (the first invalid label ends the run). valid bool [batch, seq]. Worked example: valid
    [[0, 1, 1, 1, 0, 1]], B 3, anchors [[1, 2]] -> [[[1, 1, 0], [1, 0, 0]]] (x5 comes after x4)."""
    seq = valid.shape[1]
    pos = block_position_ids(anchors + 1, block_size).view(*anchors.shape, block_size)  # label positions
    ok = valid.gather(1, pos.clamp(max=seq - 1).flatten(1)).view_as(pos) & (pos < seq)
    return ok.long().cumprod(-1).bool() & anchor_valid[:, :, None]


def next_token_slot_weights(num_slots: int, gamma: float) -> Tensor:
    """float32 [num_slots]: slot k (draft k + 1) weighs exp(-k / gamma)."""
    return torch.exp(-torch.arange(num_slots, dtype=torch.float32) / gamma)


def block_mask_mod(anchors: Tensor, anchor_valid: Tensor, ctx_len: int, block_size: int) -> MaskMod:
    """The block attention rule (module docstring) as a flex-attention mask function."""
    anchors = anchors.long()
    valid = anchor_valid.to(torch.bool)
    n, size = int_scalar(ctx_len, anchors), int_scalar(block_size, anchors)  # tensors: no compile per value

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        block = q_idx // size
        is_ctx = kv_idx < n
        ctx_visible = is_ctx & valid[b, block] & (kv_idx < anchors[b, block])
        same_block = ~is_ctx & ((kv_idx - n) // size == block)
        return ctx_visible | same_block

    return mask_mod


def block_attention_mask(anchors: Tensor, anchor_valid: Tensor, ctx_len: int, block_size: int) -> AttentionMask:
    """`AttentionMask` of the block rule: nb * B queries against ctx_len + nb * B keys; pass it to
    `drafters.common.attention.attend` (SDPA evaluates `dense()`, flex builds a BlockMask)."""
    if anchors.shape != anchor_valid.shape or anchors.dim() != 2:
        raise ValueError(f"anchors {tuple(anchors.shape)} / anchor_valid {tuple(anchor_valid.shape)}: "
                         "expected equal shapes [batch, num_blocks]")
    batch, nb = anchors.shape
    q_len = nb * block_size
    return AttentionMask(block_mask_mod(anchors, anchor_valid, ctx_len, block_size), batch, q_len, ctx_len + q_len)


def dense_block_mask(anchors: Tensor, anchor_valid: Tensor, ctx_len: int, block_size: int) -> Tensor:
    """bool [batch, 1, nb * B, ctx_len + nb * B] for SDPA (keys = [context ; all blocks])."""
    return block_attention_mask(anchors, anchor_valid, ctx_len, block_size).dense(anchors.device)


def flex_block_mask(anchors: Tensor, anchor_valid: Tensor, ctx_len: int, block_size: int) -> Any:
    """A flex-attention `BlockMask` of the same rule on the anchors' device, or None when flex
    attention is not importable (imported lazily: importing `drafters` never touches it)."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask
    except ImportError:
        return None
    mask = block_attention_mask(anchors, anchor_valid, ctx_len, block_size)
    return create_block_mask(mask.mask_mod, mask.batch, None, mask.q_len, mask.kv_len, device=str(anchors.device))
