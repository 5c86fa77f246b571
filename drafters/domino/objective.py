"""Domino training objective (docs/design/algorithms.md section 6; SpecForge `OnlineDominoModel`): slot
k = 0 .. B - 2 drafts x_{a+k+1} (GRU input x_{a+k}), counted over the contiguous valid prefix, w_k =
exp(-k / gamma): loss = sum(w * ((1 - lam) CE(final_k) + lam CE(U_k))) / sum(w), lam = `curriculum_lambda`."""

from __future__ import annotations

import torch
from torch import Tensor

from drafters.common.blocks import (
    block_input_ids,
    block_labels,
    next_token_anchor_candidates,
    next_token_prefix_mask,
    next_token_slot_weights,
    sample_anchors,
)
from drafters.common.chunked_head import chunked_rows, hard_ce_rows, head_weight, topk_ids
from drafters.common.collate import check_batch
from drafters.common.losses import ObjectiveOutput
from drafters.common.metrics import TOP_K, block_row_metrics
from drafters.domino.config import curriculum_lambda
from drafters.domino.model import DominoDraft

REQUIRED_FIELDS = ("input_ids", "loss_mask", "aux_hidden")


def head_rows(model: DominoDraft, hidden: Tensor, gru: Tensor, labels: Tensor,
              slot: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """hidden [N, H], gru [N, G], labels int64 [N], slot int64 [N] -> (CE final [N], CE base [N], base
    argmax [N], final top-5 ids [N, 5]), chunked (common/chunked_head.py)."""

    head = head_weight(model.target_lm_head, hidden)  # [V, H], cast once (if at all), not per chunk

    def terms(h: Tensor, g: Tensor, y: Tensor, k: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        base, final = model.row_logits(h, g, k, head)  # [n, V] each
        return hard_ce_rows(final, y), hard_ce_rows(base, y), base.detach().argmax(-1), topk_ids(final, TOP_K)

    ce_final, ce_base, base_argmax, top = chunked_rows(terms, [hidden, gru, labels, slot], model.cfg.loss_chunk_rows)
    return ce_final, ce_base, base_argmax, top


def domino_loss(ce_final: Tensor, ce_base: Tensor, base_argmax: Tensor, top: Tensor, labels: Tensor, slot: Tensor,
                lam: float, gamma: float, num_slots: int) -> ObjectiveOutput:
    """The curriculum CE over N rows from `head_rows`' outputs, with its metrics (ce_final, ce_base,
    lambda, acc_base, common/metrics.block_row_metrics of the final logits)."""
    row = (1.0 - lam) * ce_final + lam * ce_base
    w = next_token_slot_weights(num_slots, gamma).to(row.device)[slot]  # [N]
    num, den = (w * row).sum(), w.sum().detach()
    with torch.no_grad():
        one = torch.ones((), device=row.device)
        metrics: dict[str, tuple[Tensor, Tensor]] = {
            "ce_final": ((w * ce_final).sum(), den), "ce_base": ((w * ce_base).sum(), den),
            "lambda": (one * lam, one),
            "acc_base": ((base_argmax == labels).float().sum(), one * labels.numel()),
        }
        metrics.update(block_row_metrics(top, labels, slot + 1, row, num_slots))
    return ObjectiveOutput(num.view(1), den.view(1), torch.ones(1, device=num.device), metrics)


def domino_objective(model: DominoDraft, batch: dict[str, Tensor], progress: float = 0.0,
                     generator: torch.Generator | None = None) -> ObjectiveOutput:
    """One micro-batch: sample anchors (with `generator`), backbone + GRU head, curriculum CE. batch:
    input_ids, loss_mask, attention_mask [batch, seq], aux_hidden [batch, seq, m*H]; progress drives lam."""
    check_batch(batch, REQUIRED_FIELDS, "Domino")
    cfg = model.cfg
    assert cfg.mask_token_id is not None
    bs, slots = cfg.block_size, cfg.block_size - 1
    ids = batch["input_ids"]
    valid = batch["loss_mask"].to(torch.bool) & batch["attention_mask"].to(torch.bool)  # [batch, seq]
    anchors, anchor_valid = sample_anchors(next_token_anchor_candidates(valid), 1, cfg.num_anchors, generator)
    select = next_token_prefix_mask(valid, anchors, anchor_valid, bs)[:, :, :slots]  # [batch, nb, B-1]
    labels = block_labels(ids, anchors + 1, bs)[:, :, :slots][select]  # [N]: x_{a+k+1}
    prev = block_labels(ids, anchors, bs)[:, :, :slots]  # [batch, nb, B-1]: x_{a+k}
    hidden, gru = model(batch["aux_hidden"], block_input_ids(ids, anchors, bs, cfg.mask_token_id), anchors,
                        anchor_valid, prev, select)  # [N, H], [N, G]
    slot = select.nonzero(as_tuple=True)[2]  # [N]
    ce_final, ce_base, base_argmax, top = head_rows(model, hidden, gru, labels, slot)
    return domino_loss(ce_final, ce_base, base_argmax, top, labels, slot, curriculum_lambda(cfg, progress),
                       cfg.loss_gamma, slots)
