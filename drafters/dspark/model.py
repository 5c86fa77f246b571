"""DSpark draft: the DFlash backbone + Markov head + confidence head (docs/design/algorithms.md section 5).
Per row, post-norm hidden h [H] and Markov predecessor x_prev:
    e = W1[x_prev]  (gated: sigmoid(gate_proj([h ; W1[x_prev]])) * W1[x_prev])   # [r]
    draft logits = target_lm_head(h) + W2 e                                       # [V]
    confidence = sigmoid(proj([h ; e]))  (or proj(h))                              # scalar"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from drafters.common.chunked_head import wide_float
from drafters.common.target import TargetHead
from drafters.dflash.model import DFlashDraft
from drafters.dspark.config import DSparkConfig


class MarkovHead(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, rank: int, kind: str):
        super().__init__()
        self.kind = kind
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = nn.Linear(rank, vocab_size, bias=False)
        if kind == "gated":
            self.gate_proj = nn.Linear(hidden_size + rank, rank)
        nn.init.normal_(self.markov_w1.weight, std=0.02)
        nn.init.normal_(self.markov_w2.weight, std=0.02)

    def features(self, prev_ids: Tensor, hidden: Tensor) -> Tensor:
        """prev_ids int64 [...], hidden [..., H] -> e [..., r]."""
        e = self.markov_w1(prev_ids).to(hidden.dtype)
        if self.kind == "gated":
            e = torch.sigmoid(self.gate_proj(torch.cat([hidden, e], dim=-1))) * e
        return e

    def bias(self, e: Tensor) -> Tensor:
        """e [..., r] -> [..., V]."""
        return self.markov_w2(e)


class ConfidenceHead(nn.Module):
    def __init__(self, in_features: int):
        super().__init__()
        self.proj = nn.Linear(in_features, 1)

    def forward(self, x: Tensor) -> Tensor:
        """[..., H (+ r)] -> probability [...] (float32; float64 stays float64)."""
        return torch.sigmoid(wide_float(self.proj(x)).squeeze(-1))


@dataclass
class DSparkRows:
    """The selected rows of one forward before the vocab projection: hidden [N, H], markov [N, r] (None
    without a Markov head), confidence [N] float32 (None without a confidence head)."""

    hidden: Tensor
    markov: Tensor | None
    confidence: Tensor | None


class DSparkDraft(DFlashDraft):
    """`cfg` is resolved against `target.spec` (the backbone's rules), then the heads are built."""

    cfg: DSparkConfig

    def __init__(self, cfg: DSparkConfig, target: TargetHead):
        super().__init__(cfg, target)
        spec, r = target.spec, cfg.markov_rank
        if cfg.ce_mode != "full" and cfg.ce_vocab >= spec.vocab_size:
            raise ValueError(f"ce_vocab: got {cfg.ce_vocab}, expected < vocab_size={spec.vocab_size} "
                             "(use ce_mode 'full' for the whole vocabulary)")
        self.markov_head = MarkovHead(spec.vocab_size, spec.hidden_size, r, cfg.markov_head_type) if r else None
        if cfg.enable_confidence_head:
            extra = r if cfg.confidence_head_with_markov else 0
            self.confidence_head: ConfidenceHead | None = ConfidenceHead(spec.hidden_size + extra)
        else:
            self.confidence_head = None

    def markov_features(self, hidden: Tensor, prev_ids: Tensor) -> Tensor | None:
        """hidden [..., H], prev_ids int64 [...] -> e [..., r] (None without a Markov head)."""
        return None if self.markov_head is None else self.markov_head.features(prev_ids, hidden)

    def draft_logits(self, hidden: Tensor, markov: Tensor | None, head: Tensor | None = None) -> Tensor:
        """hidden [..., H], e [..., r] or None -> draft logits [..., V] = U + W2 e (head: see `logits`)."""
        base = self.logits(hidden, head)  # [..., V]
        if markov is None:
            return base
        assert self.markov_head is not None
        return base + self.markov_head.bias(markov)

    def row_confidence(self, hidden: Tensor, markov: Tensor | None) -> Tensor | None:
        """hidden [..., H], e [..., r] or None -> confidence [...] float32 (None without the head)."""
        if self.confidence_head is None:
            return None
        if markov is not None and self.cfg.confidence_head_with_markov:
            return self.confidence_head(torch.cat([hidden, markov], dim=-1))  # [..., H + r]
        return self.confidence_head(hidden)

    def head_logits(self, hidden: Tensor, prev_ids: Tensor) -> tuple[Tensor, Tensor | None]:
        """hidden [..., H], prev_ids [...] -> (draft logits [..., V], confidence [...] or None)."""
        e = self.markov_features(hidden, prev_ids)
        return self.draft_logits(hidden, e), self.row_confidence(hidden, e)

    def forward(self, features: Tensor, block_ids: Tensor, anchors: Tensor, anchor_valid: Tensor,  # type: ignore[override]
                prev_ids: Tensor, select: Tensor) -> DSparkRows:
        """Backbone over the blocks, then Markov features and confidence on the rows where `select`
        (bool [batch, nb, B]) holds, in `select.nonzero()` order; prev_ids int64 [batch, nb, B]."""
        hidden = self.block_hidden(features, block_ids, anchors, anchor_valid)[select]  # [N, H]
        e = self.markov_features(hidden, prev_ids[select])  # [N, r] or None
        return DSparkRows(hidden, e, self.row_confidence(hidden, e))
