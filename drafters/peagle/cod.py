"""P-EAGLE numerics: COD sampling, the flattened element layout and its attention mask
(docs/design/algorithms.md section 7; speculators `models/peagle/{data,attention}.py`).

All K depths train in one forward over elements (a, d), depth-major per row: the T depth-0 elements,
then the anchors COD kept at each depth (padding: `exists` False). Element (a, d) is draft slot d of a
round whose last verified row is a: position position_ids[a] + d, input (x_{a+1}, fc(aux f_a)) at d = 0
else (MASK, fc(mask_hidden)), target the distribution at a + 1 + d. COD keeps count_d = min(|pool_d|,
floor((n_valid - d) * max(r^d, r_min))) anchors of depth d - 1 (floor adds 1e-9: 100 * 0.7 ** 2 -> 49).
Element q sees k iff same document and k is depth 0 at or before q's anchor or an earlier-or-equal depth
of q's chain. Worked example, T = 3, COD kept (1, 1), (1, 2); elements [(0,0) (1,0) (2,0) (1,1) (1,2)]:
    (0,0): 1 0 0 0 0
    (1,0): 1 1 0 0 0
    (2,0): 1 1 1 0 0
    (1,1): 1 1 0 1 0
    (1,2): 1 1 0 1 1
The mask reads index tables (`q_index`, `kv_index`), so a partitioned forward evaluates the same function."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from drafters.common.attention import BlockGatherMask
from drafters.common.masks import AttentionMask, MaskMod

EPS = 1e-9  # floor((n - d) * ratio + EPS): the count the formula means despite float rounding


def cod_count(n_valid: int, depth: int, ratio: float, ratio_min: float) -> int:
    """The COD budget of depth `depth` >= 1: floor((n_valid - depth) * max(ratio^depth, ratio_min))."""
    if depth < 1:
        raise ValueError(f"depth: got {depth}, expected >= 1 (depth 0 keeps every position)")
    return max(0, math.floor(max(0, n_valid - depth) * max(ratio ** depth, ratio_min) + EPS))


@dataclass
class CODLayout:
    """Per batch row, N elements (module docstring), depth-major: anchor, depth int64 [B, N]; exists bool
    [B, N]; document int64 [B, T] (-1 = padding); counts int64 [B, K] elements per depth."""

    anchor: Tensor
    depth: Tensor
    exists: Tensor
    document: Tensor
    counts: Tensor

    @property
    def seq_len(self) -> int:
        return int(self.document.shape[1])

    def element_document(self) -> Tensor:
        """int64 [B, N]: each element's document (its anchor's), -1 for padding elements."""
        doc = torch.gather(self.document, 1, self.anchor)
        return torch.where(self.exists, doc, torch.full_like(doc, -1))

    def target_position(self) -> Tensor:
        """int64 [B, N]: a + 1 + d, the position of each element's target (clamped to T - 1 for
        padding elements and past-the-end targets, which carry no loss)."""
        return (self.anchor + 1 + self.depth).clamp(max=self.seq_len - 1)

    def position_ids(self, position_ids: Tensor | None = None) -> Tensor:
        """int64 [B, N]: RoPE position of each element, position_ids[a] + d (default positions 0..T-1)."""
        if position_ids is None:
            return self.anchor + self.depth
        return torch.gather(position_ids.long(), 1, self.anchor) + self.depth


def document_ids(attention_mask: Tensor, document: Tensor | None = None) -> Tensor:
    """int64 [B, T]: `document` (packed rows) or 0 at every real position; -1 at padding."""
    real = attention_mask.to(torch.bool)
    doc = torch.zeros(real.shape, dtype=torch.long, device=real.device) if document is None else document.long()
    return torch.where(real, doc, torch.full_like(doc, -1))


def chain_valid(target_valid: Tensor, document: Tensor, depth: int) -> Tensor:
    """bool [B, T]: valid(a, depth) for every anchor a (module docstring)."""
    b, t = target_valid.shape
    valid = torch.zeros(b, t, dtype=torch.bool, device=target_valid.device)
    shift = 1 + depth
    if shift < t:
        valid[:, : t - shift] = (target_valid[:, shift:].to(torch.bool) & (document[:, shift:] == document[:, : t - shift])
                                 & (document[:, : t - shift] >= 0))
    return valid


def cod_sample(target_valid: Tensor, document: Tensor, num_depths: int, ratio: float, ratio_min: float,
               generator: torch.Generator | None = None) -> CODLayout:
    """COD sampling over `num_depths` depths (module docstring): target_valid bool [B, T], document int64
    [B, T] (`document_ids`); draws use the CPU `generator` only."""
    if target_valid.shape != document.shape or target_valid.dim() != 2:
        raise ValueError(f"target_valid {tuple(target_valid.shape)} and document {tuple(document.shape)}: "
                         "expected the same [batch, seq] shape")
    if num_depths < 1:
        raise ValueError(f"num_depths: got {num_depths}, expected >= 1")
    b, t = target_valid.shape
    device = target_valid.device
    valid = [chain_valid(target_valid, document, d).cpu() for d in range(num_depths)]
    anchors: list[list[Tensor]] = []
    counts = torch.zeros(b, num_depths, dtype=torch.long)
    for row in range(b):
        kept = valid[0][row].nonzero().flatten()
        n_valid = int(kept.numel())
        per_depth = [torch.arange(t)]
        counts[row, 0] = int((document[row] >= 0).sum())
        for d in range(1, num_depths):
            pool = kept[valid[d][row, kept]]
            count = min(int(pool.numel()), cod_count(n_valid, d, ratio, ratio_min))
            if count == 0:
                break
            pick = torch.randperm(int(pool.numel()), generator=generator)[:count]
            kept = pool[pick].sort().values
            per_depth.append(kept)
            counts[row, d] = count
        anchors.append(per_depth)
    n = max(sum(int(x.numel()) for x in per) for per in anchors)
    anchor = torch.zeros(b, n, dtype=torch.long)
    depth = torch.zeros(b, n, dtype=torch.long)
    exists = torch.zeros(b, n, dtype=torch.bool)
    doc_cpu = document.cpu()
    for row, per in enumerate(anchors):
        a = torch.cat(per)
        dep = torch.cat([torch.full((x.numel(),), i, dtype=torch.long) for i, x in enumerate(per)])
        width = a.numel()
        anchor[row, :width], depth[row, :width] = a, dep
        exists[row, :width] = doc_cpu[row, a] >= 0
    return CODLayout(anchor.to(device), depth.to(device), exists.to(device), document, counts.to(device))


def chain_layout(num_rows: int, num_depths: int, device: torch.device | str = "cpu") -> CODLayout:
    """One sequence of n verified rows plus the mask slots (n - 1, 1..K-1): one parallel-drafting forward
    (inference) in the training layout's terms; position n anchors no element."""
    if num_rows < 1 or num_depths < 1:
        raise ValueError(f"chain_layout: need num_rows >= 1 and num_depths >= 1, got {num_rows}, {num_depths}")
    anchor = torch.cat([torch.arange(num_rows), torch.full((num_depths - 1,), num_rows - 1)])
    depth = torch.cat([torch.zeros(num_rows, dtype=torch.long), torch.arange(1, num_depths)])
    counts = torch.tensor([[num_rows] + [1] * (num_depths - 1)])
    return CODLayout(anchor[None].to(device), depth[None].to(device),
                     torch.ones(1, anchor.numel(), dtype=torch.bool, device=device),
                     torch.zeros(1, num_rows + 1, dtype=torch.long, device=device), counts.to(device))


def cod_mask_mod(layout: CODLayout, q_index: Tensor | None = None, kv_index: Tensor | None = None) -> MaskMod:
    """The attention rule (module docstring) as a mask function; q_index / kv_index: int64 [B, Nq]
    / [B, Nk] element ids of the query rows / key columns (-1 = padding; default all elements)."""
    anchor, depth, exists = layout.anchor, layout.depth, layout.exists
    doc = layout.element_document()

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        qi = q_idx if q_index is None else q_index[b, q_idx]
        ki = kv_idx if kv_index is None else kv_index[b, kv_idx]
        qs, ks = qi.clamp(min=0), ki.clamp(min=0)
        qa, ka, qd, kd = anchor[b, qs], anchor[b, ks], depth[b, qs], depth[b, ks]
        real = (qi >= 0) & (ki >= 0) & exists[b, qs] & exists[b, ks] & (doc[b, qs] == doc[b, ks])
        rule = ((kd == 0) & (ka <= qa)) | ((ka == qa) & (kd <= qd))
        return (real & rule) | (qi == ki)

    return mask_mod


def cod_attention_mask(layout: CODLayout, q_index: Tensor | None = None,
                       kv_index: Tensor | None = None) -> AttentionMask:
    """`cod_mask_mod` with its sizes: [B, Nq, Nk] (default every element against every element)."""
    b, n = layout.anchor.shape
    nq = n if q_index is None else int(q_index.shape[1])
    nk = n if kv_index is None else int(kv_index.shape[1])
    return AttentionMask(cod_mask_mod(layout, q_index, kv_index), b, nq, nk)


def cod_structured_mask(layout: CODLayout, q_index: Tensor | None = None,
                        kv_index: Tensor | None = None) -> BlockGatherMask:
    """`cod_attention_mask` with its structure for the CPU fast path (`block_gather_sdpa`): the first T
    key columns (depth 0) as the dense block, a query's own chain gathered; padding queries see key 0."""
    b, n = layout.anchor.shape
    t, k = layout.seq_len, int(layout.counts.shape[1])
    dev = layout.anchor.device
    base = torch.arange(t, device=dev).expand(b, t)
    if kv_index is not None and not torch.equal(kv_index[:, :t], base):
        raise ValueError("kv_index: the first T key columns must be the depth-0 elements 0..T-1")
    q_ids = torch.arange(n, device=dev).expand(b, n) if q_index is None else q_index
    kv_ids = torch.arange(n, device=dev).expand(b, n) if kv_index is None else kv_index
    plain = cod_attention_mask(layout, q_index, kv_index)
    block = AttentionMask(cod_mask_mod(layout, q_index, base), b, plain.q_len, t).dense(dev)  # [B, 1, Nq, T]
    empty = ~block.any(-1)  # [B, 1, Nq]
    block[..., 0] |= empty
    # key position of each element in the key layout (-1: not a key), then each query's chain keys
    key_pos = torch.full((b, n), -1, dtype=torch.long, device=dev)
    real_kv = kv_ids >= 0
    rows = real_kv.nonzero(as_tuple=True)
    key_pos[rows[0], kv_ids[rows]] = rows[1]
    table = torch.full((b, t, k), -1, dtype=torch.long, device=dev)  # (anchor, depth) -> element id
    el = layout.exists.nonzero(as_tuple=True)
    table[el[0], layout.anchor[el], layout.depth[el]] = el[1]
    qs = q_ids.clamp(min=0)
    qa, qd = torch.gather(layout.anchor, 1, qs), torch.gather(layout.depth, 1, qs)  # [B, Nq]
    depths = torch.arange(1, k, device=dev)  # chain slots 1..K-1
    chain = table[torch.arange(b, device=dev)[:, None, None], qa[..., None], depths.expand(*qa.shape, k - 1)]
    chain = torch.where((depths <= qd[..., None]) & (q_ids[..., None] >= 0) & (chain >= 0),
                        torch.gather(key_pos, 1, chain.clamp(min=0).flatten(1)).view_as(chain), -1)
    chain = torch.where(chain >= t, chain, -1)  # depth >= 1 keys only (never in the block)
    return BlockGatherMask(plain.mask_mod, b, plain.q_len, plain.kv_len, block, chain)


def segment_indices(layout: CODLayout, num_segments: int) -> list[Tensor]:
    """Sequence partitioning: the depth >= 1 elements split into `num_segments` anchor ranges, per segment
    an int64 [B, Ns] table of element ids (-1 = padding), empty ones dropped."""
    if num_segments < 1:
        raise ValueError(f"num_segments: got {num_segments}, expected >= 1")
    t = layout.seq_len
    deep = layout.exists & (layout.depth >= 1)
    bounds = [round(s * t / num_segments) for s in range(num_segments + 1)]
    out = []
    for lo, hi in zip(bounds, bounds[1:]):
        member = deep & (layout.anchor >= lo) & (layout.anchor < hi)  # [B, N]
        width = int(member.sum(1).max()) if member.numel() else 0
        if width == 0:
            continue
        table = torch.full((member.shape[0], width), -1, dtype=torch.long, device=member.device)
        for row in range(member.shape[0]):
            ids = member[row].nonzero().flatten()
            table[row, : ids.numel()] = ids
        out.append(table)
    return out
