"""DFlash training objective (docs/design/algorithms.md section 4).

Per step: sample `num_anchors` anchors per sequence among positions a with loss_mask[a] and
a + B <= length (common/blocks.py), feed blocks [x_a, MASK x (B - 1)] at positions a..a+B-1.
Labels: slot k >= 1 of block a predicts x_{a+k} (the MASK slot denoises its own token); slot 0
carries no loss. Slot weights w_k = exp(-(k - 1) / gamma), w_0 = 0.

    valid[b, j, k] = anchor_valid[b, j] & k >= 1 & a_j + k < length & loss_mask[a_j + k]
    loss = sum(w_k * CE * valid) / sum(w_k * valid)

returned as one ObjectiveOutput term (numerator sum, denominator sum of weights) so the
denominator can be all-reduced (common/losses.py).

Worked example, B = 3, gamma = 7: w = [0, 1, exp(-1/7)] = [0, 1, 0.8668]; one valid block with
CE (., 2.0, 1.0) gives (2.0 + 0.8668) / 1.8668 = 1.5357.
"""

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
    """float32 [B]: [0, w_1, ..., w_{B-1}], w_k = exp(-(k - 1) / gamma).

    Worked example: B 4, gamma 2 -> [0, 1, e^-0.5, e^-1] = [0, 1, 0.6065, 0.3679].
    """
    k = torch.arange(block_size, dtype=torch.float32)
    w = torch.exp(-(k - 1) / gamma)
    w[0] = 0.0
    return w


def label_mask(loss_mask: Tensor, anchors: Tensor, anchor_valid: Tensor, block_size: int) -> Tensor:
    """bool [batch, nb, B]: which block slots carry loss (module docstring `valid`).

    loss_mask [batch, seq] (0 on padding). Worked example: loss_mask [[0, 1, 1, 0, 1]], anchors
    [[1]], valid [[1]], B 3 -> [[[0, 1, 0]]] (slot 0 never; slot 2 is position 3, not in the mask).
    """
    seq = loss_mask.shape[1]
    pos = block_position_ids(anchors, block_size).view(*anchors.shape, block_size)  # [batch, nb, B]
    inside = pos < seq
    lm = loss_mask.to(torch.bool).gather(1, pos.clamp(max=seq - 1).flatten(1)).view_as(pos) & inside
    slot = torch.arange(block_size, device=anchors.device) >= 1
    return lm & slot & anchor_valid.to(torch.bool)[:, :, None]


def dflash_loss(ce: Tensor, top: Tensor, labels: Tensor, slot: Tensor, gamma: float, block_size: int) -> ObjectiveOutput:
    """The weighted CE of the module docstring over the N valid rows, from the chunked head's per-row
    outputs (`head_rows`): ce [N] (differentiable), top int64 [N, k] (top ids, best first), labels
    int64 [N], slot int64 [N] in 1..B-1. Metrics (sum, count), common/metrics.block_row_metrics:
    acc / top5 over valid slots (unweighted), acc_pos{k} / loss_pos{k} (mean CE) for k = 1..B-1,
    valid_tokens."""
    wk = slot_weights(block_size, gamma).to(ce.device)[slot]  # [N]
    num = (wk * ce).sum()
    den = wk.sum().detach()
    metrics = block_row_metrics(top, labels, slot, ce, block_size - 1)  # slot k drafts d_k
    return ObjectiveOutput(num.view(1), den.view(1), torch.ones(1, device=num.device), metrics)


def head_rows(model: DFlashDraft, hidden: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    """hidden [N, H] post-norm rows, labels int64 [N] -> (CE [N], top-5 ids [N, 5]) through the frozen
    target lm_head (`model.logits`), `cfg.loss_chunk_rows` rows at a time, fused: the head is frozen and
    CE is per row, so each chunk's logits are used once, in the forward (common/chunked_head.py,
    `frozen_head_ce_rows`: no logits recompute in the backward)."""
    head = head_weight(model.target_lm_head, hidden)  # [V, H], cast once (if at all), not per chunk
    return frozen_head_ce_rows(hidden, head, labels, model.cfg.loss_chunk_rows, TOP_K)


def dflash_objective(model: DFlashDraft, batch: dict[str, Tensor],
                     generator: torch.Generator | None = None) -> ObjectiveOutput:
    """One micro-batch: sample anchors (with `generator`), run the backbone, weighted CE.

    batch: input_ids [batch, seq], loss_mask [batch, seq], attention_mask bool [batch, seq],
    aux_hidden [batch, seq, m*H] (the context layers' features, row p = position p). The target
    lm_head runs on the valid rows only.
    """
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
