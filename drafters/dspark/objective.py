"""DSpark training objective (docs/design/algorithms.md section 5; DeepSpec loss). Slot k of a block at
anchor a: label x_{a+k+1}, Markov predecessor x_{a+k}, target p_t from the target head at a + k, counted
over the contiguous valid prefix; per counted row, weight w_k = exp(-k / gamma):
    ce   = CE(p_d, label)            (full, restricted or sampled: `ce_rows`)
    l1   = sum_v |p_d - p_t|         (= 2 TV, always over the full vocabulary)
    conf = BCE(c_k, 1 - 0.5 * l1)    (target detached; 0 without a confidence head)
    loss = sum(w * (ce_weight * ce + l1_weight * l1 + conf_weight * conf)) / sum(w), finite rows only"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from drafters.common.blocks import (
    block_input_ids,
    block_labels,
    next_token_anchor_candidates,
    next_token_prefix_mask,
    next_token_slot_weights,
    sample_anchors,
)
from drafters.common.chunked_head import (
    hard_ce_rows,
    head_weight,
    l1_rows,
    topk_ids,
    wide_float,
)
from drafters.common.collate import check_batch
from drafters.common.fused_head import bias_matrix, fused_head_loss
from drafters.common.losses import ObjectiveOutput
from drafters.common.metrics import TOP_K, block_row_metrics
from drafters.dspark.config import DSparkConfig
from drafters.dspark.model import DSparkDraft, DSparkRows

REQUIRED_FIELDS = ("input_ids", "loss_mask", "aux_hidden", "last_hidden")


def sampled_negatives(vocab: int, cfg: DSparkConfig, device: torch.device,
                      generator: torch.Generator | None = None) -> Tensor | None:
    """ce_mode "sampled": the n = ce_vocab negatives (int64 [n], a uniform draw without replacement,
    the same for every row), drawn once per micro-batch before the chunked loss; None otherwise."""
    if cfg.ce_mode != "sampled":
        return None
    draw_on = generator.device if generator is not None else device
    return torch.randperm(vocab, generator=generator, device=draw_on)[: cfg.ce_vocab].to(device)  # [n]


def ce_rows(logits: Tensor, labels: Tensor, target_logits: Tensor, cfg: DSparkConfig,
            negatives: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """Per-row CE [n] and candidate count [n] of one chunk (logits, target_logits [n, V], labels [n]):
    full; restricted to the target's top ce_vocab plus the label; or sampled (shared negatives,
    -z_y + logsumexp([z_y, z_neg + log((V - 1) / n)]))."""
    n_rows, vocab = logits.shape
    if cfg.ce_mode == "full":
        return hard_ce_rows(logits, labels), torch.full((n_rows,), float(vocab), device=logits.device)
    z = wide_float(logits)
    zy = z.gather(1, labels[:, None]).squeeze(1)
    if cfg.ce_mode == "restricted":
        target_probs = torch.softmax(wide_float(target_logits.detach()), dim=-1)  # [n, V]
        top = target_probs.topk(cfg.ce_vocab, dim=-1).indices  # [n, c]
        member = torch.zeros_like(z, dtype=torch.bool).scatter_(1, top, True)
        member.scatter_(1, labels[:, None], True)
        lse = torch.logsumexp(z.masked_fill(~member, float("-inf")), dim=-1)
        return lse - zy, member.sum(-1).float()
    if negatives is None:
        raise ValueError("ce_mode 'sampled': negatives missing (sampled_negatives)")
    keep = negatives[None, :] != labels[:, None]  # [n, c]
    corr = math.log((vocab - 1) / cfg.ce_vocab)
    zneg = (z[:, negatives] + corr).masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(torch.cat([zy[:, None], zneg], dim=1), dim=-1)
    return lse - zy, 1.0 + keep.sum(-1).float()


def head_loss(model: DSparkDraft, rows: DSparkRows, labels: Tensor, target_hidden: Tensor, negatives: Tensor | None,
              slot_w: Tensor, conf_ok: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The vocab-wide terms of N rows, fused chunk by chunk: (sum of slot_w * (ce_weight * ce + l1_weight *
    l1) over finite rows, differentiable; per row without grad: ce, candidates, l1, the term, top-5, finite)."""
    cfg = model.cfg
    head = head_weight(model.target_lm_head, rows.hidden)  # [V, H], cast once (if at all), not per chunk
    target_head = head if target_hidden.dtype == rows.hidden.dtype else head_weight(model.target_lm_head, target_hidden)
    bias = None
    if rows.markov is not None:
        assert model.markov_head is not None
        bias = bias_matrix(model.markov_head.markov_w2, cfg.markov_rank, rows.markov)  # [r, V]

    def row_loss(z: Tensor, t: Tensor, start: int, stop: int) -> tuple[Tensor, tuple[Tensor, ...]]:
        ce, size = ce_rows(z, labels[start:stop], t, cfg, negatives)
        l1 = l1_rows(z, t)
        term = cfg.ce_weight * ce + cfg.l1_weight * l1  # [n]
        ok = torch.isfinite(term) & conf_ok[start:stop]
        loss = (slot_w[start:stop] * torch.where(ok, term, torch.zeros_like(term))).sum()
        return loss, (ce, size, l1, term, topk_ids(z, TOP_K), ok)

    num, (ce, size, l1, term, top, ok) = fused_head_loss(rows.hidden, target_hidden, head, target_head, rows.markov,
                                                         bias, row_loss, cfg.loss_chunk_rows)
    return num, ce, size, l1, term, top, ok


def dspark_objective(model: DSparkDraft, batch: dict[str, Tensor],
                     generator: torch.Generator | None = None) -> ObjectiveOutput:
    """One micro-batch (module docstring). batch: input_ids, loss_mask, attention_mask [batch, seq],
    aux_hidden [batch, seq, m*H], last_hidden [batch, seq, H] (post-norm)."""
    check_batch(batch, REQUIRED_FIELDS, "DSpark")
    cfg = model.cfg
    assert cfg.mask_token_id is not None
    bs = cfg.block_size
    ids = batch["input_ids"]
    valid = batch["loss_mask"].to(torch.bool) & batch["attention_mask"].to(torch.bool)  # [batch, seq]
    anchors, anchor_valid = sample_anchors(next_token_anchor_candidates(valid), 1, cfg.num_anchors, generator)  # [batch, nb]
    select = next_token_prefix_mask(valid, anchors, anchor_valid, bs)  # [batch, nb, B]
    labels = block_labels(ids, anchors + 1, bs)[select]  # [N]
    prev = block_labels(ids, anchors, bs)  # [batch, nb, B]: x_{a+k}
    rows = model(batch["aux_hidden"], block_input_ids(ids, anchors, bs, cfg.mask_token_id), anchors, anchor_valid,
                 prev, select)
    b, j, k = select.nonzero(as_tuple=True)
    pos = (anchors[b, j] + k).clamp(max=ids.shape[1] - 1)  # [N]: p_t from the last hidden at a + k
    negatives = sampled_negatives(model.target_lm_head.shape[0], cfg, rows.hidden.device, generator)
    slot_w = next_token_slot_weights(bs, cfg.loss_gamma).to(rows.hidden.device)[k]  # [N]
    # the confidence BCE is finite iff the confidence is (its target is clamped to [0, 1], the log to >= -100)
    conf_ok = torch.ones_like(labels, dtype=torch.bool) if rows.confidence is None else torch.isfinite(rows.confidence)
    head_num, ce, ce_size, l1, head_term, top, finite = head_loss(model, rows, labels, batch["last_hidden"][b, pos], negatives,
                                                       slot_w, conf_ok.detach())
    conf_target = torch.nan_to_num((1.0 - 0.5 * l1).detach(), nan=0.0).clamp(0.0, 1.0)  # a NaN row is dropped below
    if rows.confidence is not None:
        conf = F.binary_cross_entropy(rows.confidence.clamp(1e-6, 1 - 1e-6), conf_target, reduction="none")
    else:
        conf = torch.zeros_like(l1)
    w = slot_w * finite.float()  # [N]: non-finite rows are dropped
    num = head_num + cfg.conf_weight * (w * torch.where(finite, conf, torch.zeros_like(conf))).sum()
    den = w.sum().detach()
    safe = torch.where(finite, head_term + cfg.conf_weight * conf.detach(), torch.zeros_like(ce))  # [N]: row loss (metrics)
    return ObjectiveOutput(num.view(1), den.view(1), torch.ones(1, device=num.device),
                           _metrics(top, labels, k, w, finite, ce, l1, conf.detach(), safe, ce_size, bs))


def _metrics(top: Tensor, labels: Tensor, slot: Tensor, w: Tensor, finite: Tensor, ce: Tensor, l1: Tensor,
             conf: Tensor, row_loss: Tensor, ce_size: Tensor, bs: int) -> dict[str, tuple[Tensor, Tensor]]:
    """(sum, count) metrics: weighted ce / l1 / conf terms, non-finite rows, mean CE candidates, and
    common/metrics.block_row_metrics (slot k drafts d_{k+1}); non-finite rows enter the sums as 0."""
    with torch.no_grad():
        n = torch.tensor(float(labels.numel()), device=labels.device)
        den = w.sum()
        z = lambda t: torch.where(finite, t, torch.zeros_like(t))  # noqa: E731
        out: dict[str, tuple[Tensor, Tensor]] = {
            "ce": ((w * z(ce)).sum(), den), "l1": ((w * z(l1)).sum(), den), "conf_bce": ((w * z(conf)).sum(), den),
            "nonfinite_rows": ((~finite).sum().float(), torch.ones_like(n)), "ce_vocab": (ce_size.sum(), n),
        }
        out.update(block_row_metrics(top, labels, slot + 1, z(row_loss), bs))
        return out
