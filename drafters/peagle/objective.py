"""P-EAGLE training objective (docs/design/algorithms.md section 7; SpecForge `algorithms/peagle/model.py`):
EAGLE-3's targets, COD sampling over K = num_depths (a target outside the draft vocab still extends a
chain), one flattened forward, element (a, d) scored against the target at a + 1 + d; loss = soft CE
summed over scored elements / their count (no depth decay)."""

from __future__ import annotations

import torch
from torch import Tensor

from drafters.common.collate import check_batch
from drafters.common.losses import ObjectiveOutput, masked_match_count
from drafters.eagle3.objective import prepare_targets, soft_ce_head
from drafters.peagle.cod import cod_sample, document_ids
from drafters.peagle.model import PEagleModel

REQUIRED_FIELDS = ("input_ids", "loss_mask", "aux_hidden", "last_hidden")


def peagle_objective(model: PEagleModel, batch: dict[str, Tensor],
                     generator: torch.Generator | None = None) -> ObjectiveOutput:
    """The loss of one micro-batch (module docstring). `batch` may carry `document_ids` [B, T]
    (packed rows); COD draws use `generator` (default torch's global CPU generator)."""
    check_batch(batch, REQUIRED_FIELDS, "P-EAGLE", exact=("document_ids",))
    cfg = model.cfg
    targets = prepare_targets(model, batch)
    attention = batch["attention_mask"].to(torch.bool)
    trainable = batch["loss_mask"].to(torch.bool) & attention
    document = document_ids(attention, batch.get("document_ids"))
    layout = cod_sample(trainable, document, cfg.num_depths, cfg.cod_ratio, cfg.cod_ratio_min, generator)
    hidden = model(batch["input_ids"], batch["aux_hidden"], layout)  # [B, N, H] post-norm
    target_pos = layout.target_position()  # [B, N]
    beyond = layout.anchor + 1 + layout.depth >= layout.seq_len
    scored = layout.exists & ~beyond & torch.gather(targets.position_mask, 1, target_pos)  # [B, N]
    b, n = scored.nonzero(as_tuple=True)
    p = target_pos[b, n]
    ce, draft_pred = soft_ce_head(model, hidden[b, n], targets.probs, targets.prob_row[b, p])  # [M]: lm_head + loss
    rows = torch.ones(b.shape[0], dtype=torch.bool, device=ce.device)
    num, den = ce.sum(), rows.sum().to(ce.dtype)
    target_argmax = targets.target_argmax[b, p]
    depth = layout.depth[b, n]
    metrics: dict[str, tuple[Tensor, Tensor]] = {"acc": masked_match_count(draft_pred, target_argmax, rows)}
    rows_count = torch.tensor(float(layout.counts.shape[0]), device=ce.device)
    for d in range(cfg.num_depths):
        metrics[f"acc_pos{d}"] = masked_match_count(draft_pred, target_argmax, depth == d)
        metrics[f"cod_elements_pos{d}"] = (layout.counts[:, d].sum().float(), rows_count)
    ones = torch.ones(1, device=num.device)
    return ObjectiveOutput(num.view(1), den.view(1).detach(), ones, metrics)
