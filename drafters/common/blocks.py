"""Numerics for block drafting (DFlash, DSpark, Domino share them; docs/design/algorithms.md sections 4-6).

A training batch of block drafts is laid out as
    context: the target features of every sequence position, RoPE positions 0..n-1 (n = ctx_len);
    blocks:  `num_blocks` blocks of B = block_size rows each, flattened block-major
             (query row q belongs to block q // B, slot q % B); block b starts at anchor a_b and
             occupies RoPE positions a_b .. a_b + B - 1.
Attention keys are [context ; all blocks]: key kv < n is context position kv, key kv >= n is
row kv - n of the flattened blocks.

Block attention rule: a query of block b sees the context keys at positions < a_b and every key
of its own block (non-causal inside the block); blocks never see each other. A padding block
(anchor_valid False) sees its own block only, so no softmax row is empty; it carries no loss.

Worked example, ctx_len 6, B 3, anchors (1, 3), both valid; 1 = may attend::

                 context      block 0   block 1
    rows 0-2:   1 0 0 0 0 0    1 1 1     0 0 0      (a_0 = 1: context position 0 only)
    rows 3-5:   1 1 1 0 0 0    0 0 0     1 1 1      (a_1 = 3: context positions 0, 1, 2)

Padding assumption: sequences are right-padded (common/collate.py) and anchors satisfy
a + B <= length, so every context key before an anchor is a real token.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from drafters.common.masks import AttentionMask, MaskMod, int_scalar


def sample_anchors(valid_mask: Tensor, block_size: int, num_anchors: int,
                   generator: torch.Generator | None = None) -> tuple[Tensor, Tensor]:
    """Per sequence, `num_anchors` block starts drawn uniformly without replacement.

    valid_mask: bool [batch, seq] (e.g. loss_mask & attention_mask). Candidates of a row are the
    positions a with valid_mask[a] and a + block_size <= length, where length = last True index
    + 1 (0 for an all-False row). Returns (anchors int64 [batch, nb], anchor_valid bool
    [batch, nb]) with nb = min(num_anchors, the largest candidate count of any row), at least 1
    (so a short batch never pays for num_anchors blocks of padding): per row the chosen anchors
    in increasing order, then padding entries (anchor 0, anchor_valid False) when the row has
    fewer than nb candidates. The draw uses `generator` only (same generator state -> same
    anchors), on the generator's device.

    Worked example: valid_mask [[0, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 1]], block_size 3: row 0
    (length 5) has candidates 1 and 2 (3 + 3 > 5), row 1 has 0..4; num_anchors 3 -> nb 3, row 0
    anchors [1, 2, 0] valid [1, 1, 0]; with row 0 alone, nb = 2: anchors [[1, 2]], valid [[1, 1]].
    """
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
    """RoPE positions of the flattened blocks: anchors [batch, nb] -> [batch, nb * block_size],
    block b's rows at a_b .. a_b + B - 1.

    Worked example: anchors [[1, 3]], block_size 3 -> [[1, 2, 3, 3, 4, 5]].
    """
    offsets = torch.arange(block_size, device=anchors.device)
    return (anchors.long()[:, :, None] + offsets).flatten(1)


def context_position_ids(batch: int, ctx_len: int, device: torch.device | str = "cpu") -> Tensor:
    """RoPE positions of the context: [batch, ctx_len] = 0..ctx_len-1 per row.

    Worked example: batch 2, ctx_len 3 -> [[0, 1, 2], [0, 1, 2]].
    """
    return torch.arange(ctx_len, device=device).expand(batch, ctx_len)


def block_input_ids(input_ids: Tensor, anchors: Tensor, block_size: int, mask_token_id: int) -> Tensor:
    """Block input tokens [batch, nb, block_size]: [x_{a_b}, MASK x (B - 1)] per block.

    input_ids [batch, seq]; anchors [batch, nb] (padding anchors read position 0; they carry no
    loss). Worked example: input_ids [[5, 6, 7, 8]], anchors [[1, 2]], B 3, mask 9 ->
    [[[6, 9, 9], [7, 9, 9]]].
    """
    first = input_ids.long().gather(1, anchors.long())  # [batch, nb]
    out = torch.full((*anchors.shape, block_size), mask_token_id, dtype=torch.long, device=input_ids.device)
    out[:, :, 0] = first
    return out


def block_labels(input_ids: Tensor, anchors: Tensor, block_size: int) -> Tensor:
    """Tokens at the block positions [batch, nb, block_size]: slot k of block b holds x_{a_b + k}
    (0 where a_b + k is past the sequence). DFlash: slot k >= 1 predicts its own token.

    Worked example: input_ids [[5, 6, 7, 8]], anchors [[1, 2]], B 3 -> [[[6, 7, 8], [7, 8, 0]]].
    """
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
    """bool [batch, nb, B]: in the "anchor predicts the first token" layout (slot k's label is
    x_{a+k+1}), slot k counts iff the labels a + 1 .. a + k + 1 are all inside the sequence and
    valid (the contiguous valid prefix: the first invalid label ends the run). valid bool [batch, seq].

    Worked example: valid [[0, 1, 1, 1, 0, 1]], B 3, anchors [[1, 2]] (both valid): block 1 labels
    x2, x3, x4 -> valid [1, 1, 0] -> [1, 1, 0]; block 2 labels x3, x4, x5 -> [1, 0, 1] -> [1, 0, 0]
    (x5 is valid but comes after the invalid x4).
    """
    seq = valid.shape[1]
    pos = block_position_ids(anchors + 1, block_size).view(*anchors.shape, block_size)  # label positions
    ok = valid.gather(1, pos.clamp(max=seq - 1).flatten(1)).view_as(pos) & (pos < seq)
    return ok.long().cumprod(-1).bool() & anchor_valid[:, :, None]


def next_token_slot_weights(num_slots: int, gamma: float) -> Tensor:
    """float32 [num_slots]: slot k (label x_{a+k+1}, i.e. draft k + 1) weighs exp(-k / gamma), the
    exp(-(j - 1) / gamma) of draft j. Worked example: 3 slots, gamma 2 -> [1, 0.6065, 0.3679]."""
    return torch.exp(-torch.arange(num_slots, dtype=torch.float32) / gamma)


def block_mask_mod(anchors: Tensor, anchor_valid: Tensor, ctx_len: int, block_size: int) -> MaskMod:
    """The block attention rule (module docstring) as a flex-attention mask function.

    mask_mod(b, h, q_idx, kv_idx): query q_idx is block q_idx // block_size; key kv_idx < ctx_len
    is context position kv_idx (visible iff the block is valid and kv_idx < anchor), a larger
    kv_idx is block row kv_idx - ctx_len (visible iff it lies in the query's block).
    Worked example (ctx_len 6, B 3, anchors (1, 3)): (q 4, kv 2) -> True (2 < 3);
    (q 4, kv 3) -> False; (q 4, kv 9) -> True (own block 1); (q 0, kv 9) -> False.
    """
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
    """bool [batch, 1, nb * B, ctx_len + nb * B] for SDPA (keys = [context ; all blocks]); see the
    worked example in the module docstring."""
    return block_attention_mask(anchors, anchor_valid, ctx_len, block_size).dense(anchors.device)


def flex_block_mask(anchors: Tensor, anchor_valid: Tensor, ctx_len: int, block_size: int) -> Any:
    """A flex-attention `BlockMask` of the same rule on the anchors' device, or None when flex
    attention is not importable. Meant for CUDA (the model's "auto" backend picks flex there);
    it also builds on CPU. flex_attention is imported here, lazily: importing `drafters` never
    touches it (nor CUDA)."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask
    except ImportError:
        return None
    mask = block_attention_mask(anchors, anchor_valid, ctx_len, block_size)
    return create_block_mask(mask.mask_mod, mask.batch, None, mask.q_len, mask.kv_len, device=str(anchors.device))
