"""EAGLE-3 batch preparation and training objective (docs/design/algorithms.md section 3). Targets live at
unshifted positions p (the target's draft-vocab distribution after x_p, masked by loss_mask & attention_mask
& t2d[argmax]); TTT step j, row t reads p = t + 1 + j, so all three are shifted left by 1 + j. Example:
    step 0: ids [x1, x2, x3, 0], targets [P1, P2, P3, -], mask [1, 1, 1, 0]   (loss_mask [0, 1, 1, 1])
    step 1: ids [x2, x3, 0, 0],  targets [P2, P3, -, -],  mask [1, 1, 0, 0]
Loss = sum_j ttt_decay^j * L_j / (masked rows of step j), L_j the soft CE summed over masked rows."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from drafters.common.chunked_head import draft_vocab_targets
from drafters.common.collate import check_batch
from drafters.common.fused_head import soft_ce_head_rows
from drafters.common.losses import ObjectiveOutput, geometric_weights, masked_match_count
from drafters.common.masks import shift_left
from drafters.common.metrics import simulated_acceptance_length
from drafters.eagle3.model import Eagle3Backbone, Eagle3Model

REQUIRED_FIELDS = ("input_ids", "loss_mask", "aux_hidden", "last_hidden")


@dataclass
class Eagle3Targets:
    """Position-level (unshifted) targets: target_argmax int64 [B, T], position_mask bool [B, T], probs
    float32 [P, Vd] at the P masked positions (computed once), prob_row int64 [B, T] (-1 off mask)."""

    target_argmax: Tensor
    position_mask: Tensor
    probs: Tensor
    prob_row: Tensor

    def rows_at_step(self, step: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The loss rows of TTT step `step`: (batch index [N], row index t [N], the rows of `probs` of
        their targets [N], target_argmax [N]) for the rows with at_step(step)'s mask set (position t+1+step)."""
        n = step + 1
        b, p = self.position_mask[:, n:].nonzero(as_tuple=True)
        return b, p, self.prob_row[b, p + n], self.target_argmax[b, p + n]

    def at_step(self, step: int) -> tuple[Tensor, Tensor]:
        """(target_argmax, mask) [B, T] for TTT step `step`: shifted left by step + 1."""
        n = step + 1
        return shift_left(self.target_argmax, n), shift_left(self.position_mask, n, fill=False)


def step_input_ids(input_ids: Tensor, steps: int) -> Tensor:
    """[B, T] -> [S, B, T]: step j row t holds x_{t+1+j} (0 past the end)."""
    return torch.stack([shift_left(input_ids.long(), j + 1) for j in range(steps)])


def prepare_targets(model: Eagle3Backbone[Any], batch: dict[str, Tensor]) -> Eagle3Targets:
    """Target argmax, masks and draft-vocab target distributions from `last_hidden` [B, T, H] with the
    frozen target head: one head matmul per loss-masked position, chunk by chunk."""
    last_hidden = batch["last_hidden"]
    b, t = last_hidden.shape[:2]
    candidate = batch["loss_mask"].to(torch.bool) & batch["attention_mask"].to(torch.bool)  # [B, T]
    rows = candidate.nonzero(as_tuple=True)
    argmax_rows, probs = draft_vocab_targets(model.target_logits, last_hidden[rows], model.t2d,
                                             model.cfg.loss_chunk_rows)  # [N], [P, Vd]
    argmax = torch.zeros(b, t, dtype=torch.long, device=last_hidden.device)
    argmax[rows] = argmax_rows
    mask = torch.zeros(b, t, dtype=torch.bool, device=last_hidden.device)
    mask[rows] = model.t2d[argmax_rows]
    prob_row = torch.full((b, t), -1, dtype=torch.long, device=last_hidden.device)
    prob_row[mask] = torch.arange(probs.shape[0], device=last_hidden.device)  # row-major: the kept rows' order
    return Eagle3Targets(argmax, mask, probs, prob_row)


def soft_ce_head(model: Eagle3Backbone[Any], hidden: Tensor, probs: Tensor, prob_rows: Tensor) -> tuple[Tensor, Tensor]:
    """Soft CE of the draft head against the target distributions, chunked (`soft_ce_head_rows`): hidden
    [N, H] post-norm rows, probs [P, Vd], prob_rows int64 [N] -> (soft CE [N], draft argmax [N], target ids)."""
    ce, draft_argmax = soft_ce_head_rows(model.lm_head, hidden, probs, prob_rows, model.cfg.loss_chunk_rows)
    return ce, model.draft_vocab.draft_to_target(draft_argmax)


def needed_row_starts(position_mask: Tensor, steps: int) -> list[int]:
    """First row each TTT step must compute (step j needs row t iff a position t+1+i, i >= j, carries loss;
    step 0 starts at 0). Worked example, S = 2, position_mask [[0, 0, 0, 1, 1, 0]] -> [0, 1]."""
    t = position_mask.shape[1]
    needed = torch.zeros_like(position_mask, dtype=torch.bool)
    starts = [0] * steps
    for j in range(steps - 1, 0, -1):
        needed |= shift_left(position_mask.to(torch.bool), j + 1, fill=False)
        rows = needed.any(0).nonzero()
        starts[j] = int(rows[0]) if rows.numel() else t - 1
    return starts


def eagle3_objective(model: Eagle3Model, batch: dict[str, Tensor]) -> ObjectiveOutput:
    """One micro-batch: S = ttt_steps loss terms weighted ttt_decay^j; metrics acc_step{j} and
    sim_accept_len (common/metrics.py), as (sum, count)."""
    check_batch(batch, REQUIRED_FIELDS, "EAGLE-3")
    steps = model.cfg.ttt_steps
    targets = prepare_targets(model, batch)
    ids = step_input_ids(batch["input_ids"], steps).to(batch["aux_hidden"].device)
    starts = needed_row_starts(targets.position_mask, steps)
    hidden = model.unroll(ids, batch["aux_hidden"], batch["attention_mask"].to(torch.bool),
                          row_start=starts)  # S x [B, T - starts[j], H]
    nums, dens, correct, valid = [], [], [], []
    metrics: dict[str, tuple[Tensor, Tensor]] = {}
    for j, step_hidden in enumerate(hidden):
        b, t, prob_rows, argmax = targets.rows_at_step(j)  # lm_head + loss on the N loss rows only
        ce, draft_pred = soft_ce_head(model, step_hidden[b, t - starts[j]], targets.probs, prob_rows)  # [N], [N]
        rows = torch.ones(b.shape[0], dtype=torch.bool, device=ce.device)
        nums.append(ce.sum())
        dens.append(rows.sum().to(ce.dtype))
        metrics[f"acc_step{j}"] = masked_match_count(draft_pred, argmax, rows)
        hit = torch.zeros_like(targets.position_mask)
        hit[b, t] = draft_pred == argmax
        mask = torch.zeros_like(targets.position_mask)
        mask[b, t] = True
        correct.append(hit)
        valid.append(mask)
    metrics["sim_accept_len"] = simulated_acceptance_length(torch.stack(correct), torch.stack(valid))
    return ObjectiveOutput(torch.stack(nums), torch.stack(dens).detach(),
                           geometric_weights(steps, model.cfg.ttt_decay).to(nums[0].device), metrics)
