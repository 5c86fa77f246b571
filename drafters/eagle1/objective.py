"""EAGLE-1 batch preparation and training objective (docs/design/algorithms.md section 1; SafeAILab
`eagle/train/main.py`). Row t: input token x_{t+1}, feature f_t, target f_{t+1}, mask loss_mask[t] &
real(t) & real(t + 1). Worked example, tokens [x0, x1, x2, x3, pad], loss_mask [0, 1, 1, 1, 0]:
    input ids      [x1, x2, x3, 0,  0]
    input features [f0, f1, f2, f3, 0]
    targets        [f1, f2, f3, 0,  0]
    row mask       [0,  1,  1,  0,  0]   (row 0: prompt token; row 3: no f4)
Loss: value_weight * SmoothL1(f^, f) + prob_weight * CE_soft(head(f), head(f^)), each over the masked
rows; training adds uniform noise to the input features (`feature_noise`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from drafters.common.chunked_head import head_weight, row_argmax, soft_ce_rows
from drafters.common.collate import check_batch
from drafters.common.fused_head import fused_head_loss
from drafters.common.losses import ObjectiveOutput, masked_match_count, smooth_l1_rows
from drafters.common.masks import shift_left
from drafters.common.metrics import simulated_acceptance_length
from drafters.eagle1.model import Eagle1Model

REQUIRED_FIELDS = ("input_ids", "loss_mask", "last_hidden")
NOISE_REFERENCE_LEN = 512  # SafeAILab scales the noise by 512 / seq_len


@dataclass
class Eagle1Rows:
    """The shifted training rows of a batch: input_ids [B, T] (row t = x_{t+1}), input_features
    [B, T, H] (row t = f_t), target_features [B, T, H] (row t = f_{t+1}), row_mask bool [B, T]."""

    input_ids: Tensor
    input_features: Tensor
    target_features: Tensor
    row_mask: Tensor


def shift_rows(batch: dict[str, Tensor]) -> Eagle1Rows:
    """The data layout of the module docstring (no noise)."""
    real = batch["attention_mask"].to(torch.bool)  # [B, T]
    features = batch["last_hidden"]  # [B, T, H]
    row_mask = batch["loss_mask"].to(torch.bool) & real & shift_left(real, 1, fill=False)
    return Eagle1Rows(shift_left(batch["input_ids"].long(), 1), features, shift_left(features, 1), row_mask)


def feature_noise(features: Tensor, lengths: Tensor, scale: float,
                  generator: torch.Generator | None = None) -> Tensor:
    """(U[0,1) - 0.5) * scale * 512 / lengths[b], float32 [B, T, H] on the features' device."""
    u = torch.rand(features.shape, generator=generator, device=features.device, dtype=torch.float32)
    per_sample = scale * NOISE_REFERENCE_LEN / lengths.to(features.device, torch.float32).clamp(min=1)
    return (u - 0.5) * per_sample[:, None, None]


def eagle1_objective(model: Eagle1Model, batch: dict[str, Tensor],
                     generator: torch.Generator | None = None) -> ObjectiveOutput:
    """One micro-batch: terms (SmoothL1 value loss, soft-CE prob loss), weights (v_w, p_w); metrics
    acc_step0, sim_accept_len (k = 1), vloss, ploss over masked rows."""
    check_batch(batch, REQUIRED_FIELDS, "EAGLE-1")
    rows = shift_rows(batch)
    inputs = rows.input_features
    if model.training and model.cfg.feature_noise > 0:
        lengths = batch.get("lengths", batch["attention_mask"].sum(1))
        inputs = inputs + feature_noise(inputs, lengths, model.cfg.feature_noise, generator).to(inputs.dtype)
    predicted = model(rows.input_ids, inputs, batch["attention_mask"].to(torch.bool))  # [B, T, H]
    b, t = rows.row_mask.nonzero(as_tuple=True)  # the head runs on the N loss rows only
    pred_rows, target_rows = predicted[b, t], rows.target_features[b, t].to(predicted.dtype)  # [N, H]
    ones = torch.ones(b.shape[0], dtype=torch.bool, device=predicted.device)
    vnum, den = smooth_l1_rows(pred_rows, target_rows.detach(), ones)

    head = head_weight(model.target_lm_head, pred_rows)  # [V, H], cast once (if at all), not per chunk

    def row_loss(z: Tensor, t: Tensor, start: int, stop: int) -> tuple[Tensor, tuple[Tensor, ...]]:
        return soft_ce_rows(z, t).sum(), (row_argmax(z), row_argmax(t))

    # fused (common/fused_head.py): each chunk's draft and target logits are computed once, in the forward
    pnum, (draft_argmax, target_argmax) = fused_head_loss(pred_rows, target_rows.detach(), head, head, None, None,
                                                          row_loss, model.cfg.loss_chunk_rows)  # [N] each
    cfg = model.cfg
    hits, count = masked_match_count(draft_argmax, target_argmax, ones)
    correct = torch.zeros_like(rows.row_mask)
    correct[b, t] = draft_argmax == target_argmax
    metrics = {"acc_step0": (hits, count),
               "sim_accept_len": simulated_acceptance_length(correct[None], rows.row_mask[None]),
               "vloss": (vnum.detach(), den), "ploss": (pnum.detach(), den)}
    weights = torch.tensor([cfg.value_weight, cfg.prob_weight], dtype=torch.float32, device=predicted.device)
    return ObjectiveOutput(torch.stack([vnum, pnum]), torch.stack([den, den]).detach(), weights, metrics)
