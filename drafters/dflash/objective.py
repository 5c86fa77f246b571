"""DFlash training objective (docs/design/algorithms.md section 4): blocks [x_a, MASK x (B - 1)] at
sampled anchors, slot k >= 1 predicting its own token x_{a+k} with weight w_k = exp(-(k - 1) / gamma):
    valid[b, j, k] = anchor_valid[b, j] & k >= 1 & a_j + k < length & loss_mask[a_j + k]
    loss = sum(w_k * CE * valid) / sum(w_k * valid)    (one ObjectiveOutput term)"""

from __future__ import annotations

import torch
from torch import Tensor

from drafters.common.blocks import block_input_ids, block_labels, block_position_ids, sample_anchors
from drafters.common.chunked_head import head_weight
from drafters.common.collate import check_batch
from drafters.common.fused_head import frozen_head_ce_rows
from drafters.common.losses import ObjectiveOutput
from drafters.common.metrics import TOP_K, block_row_metrics
from drafters.dflash.model import DFlashDraft

REQUIRED_FIELDS = ("input_ids", "loss_mask", "aux_hidden")


def slot_weights(block_size: int, gamma: float) -> Tensor:
    """float32 [B]: [0, w_1, ..., w_{B-1}], w_k = exp(-(k - 1) / gamma)."""
    k = torch.arange(block_size, dtype=torch.float32)
    w = torch.exp(-(k - 1) / gamma)
    w[0] = 0.0
    return w


def label_mask(loss_mask: Tensor, anchors: Tensor, anchor_valid: Tensor, block_size: int) -> Tensor:
    """bool [batch, nb, B]: which block slots carry loss (module docstring `valid`). Worked example:
    loss_mask [[0, 1, 1, 0, 1]], anchors [[1]], B 3 -> [[[0, 1, 0]]] (slot 2 is position 3, unmasked)."""
    seq = loss_mask.shape[1]
    pos = block_position_ids(anchors, block_size).view(*anchors.shape, block_size)  # [batch, nb, B]
    inside = pos < seq
    lm = loss_mask.to(torch.bool).gather(1, pos.clamp(max=seq - 1).flatten(1)).view_as(pos) & inside
    slot = torch.arange(block_size, device=anchors.device) >= 1
    return lm & slot & anchor_valid.to(torch.bool)[:, :, None]


def dflash_loss(ce: Tensor, top: Tensor, labels: Tensor, slot: Tensor, gamma: float, block_size: int) -> ObjectiveOutput:
    """The weighted CE over the N valid rows from `head_rows`' outputs (ce [N], top [N, k], labels [N],
    slot [N] in 1..B-1), with common/metrics.block_row_metrics."""
    wk = slot_weights(block_size, gamma).to(ce.device)[slot]  # [N]
    num = (wk * ce).sum()
    den = wk.sum().detach()
    metrics = block_row_metrics(top, labels, slot, ce, block_size - 1)  # slot k drafts d_k
    return ObjectiveOutput(num.view(1), den.view(1), torch.ones(1, device=num.device), metrics)


def head_rows(model: DFlashDraft, hidden: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    """hidden [N, H] post-norm rows, labels int64 [N] -> (CE [N], top-5 ids [N, 5]) through the frozen
    target lm_head, fused chunk by chunk (`frozen_head_ce_rows`)."""
    head = head_weight(model.target_lm_head, hidden)  # [V, H], cast once (if at all), not per chunk
    return frozen_head_ce_rows(hidden, head, labels, model.cfg.loss_chunk_rows, TOP_K)


def dflash_objective(model: DFlashDraft, batch: dict[str, Tensor],
                     generator: torch.Generator | None = None) -> ObjectiveOutput:
    """One micro-batch: sample anchors (with `generator`), run the backbone, weighted CE. batch:
    input_ids, loss_mask, attention_mask [batch, seq], aux_hidden [batch, seq, m*H]."""
    check_batch(batch, REQUIRED_FIELDS, "DFlash")
    cfg = model.cfg
    assert cfg.mask_token_id is not None
    bs = cfg.block_size
    loss_mask = batch["loss_mask"].to(torch.bool) & batch["attention_mask"].to(torch.bool)  # [batch, seq]
    anchors, anchor_valid = sample_anchors(loss_mask, bs, cfg.num_anchors, generator)  # [batch, nb]
    ids = batch["input_ids"]
    hidden = model(batch["aux_hidden"], block_input_ids(ids, anchors, bs, cfg.mask_token_id),
                          anchors, anchor_valid)  # [batch, nb, B, H]
    valid = label_mask(loss_mask, anchors, anchor_valid, bs)  # [batch, nb, B]
    labels = block_labels(ids, anchors, bs)  # [batch, nb, B]
    b, j, k = valid.nonzero(as_tuple=True)
    ce, top = head_rows(model, hidden[b, j, k], labels[b, j, k])  # [N], [N, 5]
    return dflash_loss(ce, top, labels[b, j, k], k, cfg.loss_gamma, bs)
