"""DSpark draft: the DFlash backbone + Markov head + confidence head (algorithms.md section 5).

Parameter names are the engines' (engines.md 2.5, 4.7): the DFlash backbone's (drafters/dflash/model.py)
plus
    markov_head.markov_w1.weight [V, r]     (an embedding: e = W1[x_prev])
    markov_head.markov_w2.weight [V, r]     (Linear(r -> V), no bias: bias = W2 e)
    markov_head.gate_proj.{weight [r, H + r], bias [r]}   (gated head only)
    confidence_head.proj.{weight [1, H (+ r)], bias [1]}

Row math, for a block row with post-norm backbone hidden h [H] and Markov predecessor x_prev:
    U = target_lm_head(h)                                 # [V] base logits
    e = W1[x_prev]  (gated: sigmoid(gate_proj([h ; W1[x_prev]])) * W1[x_prev])   # [r]
    draft logits = U + W2 e                               # [V]
    confidence = sigmoid(proj([h ; e]))  (or proj(h))     # scalar
`forward` runs the backbone and the heads on the selected rows only (FSDP's hooks wrap it);
`block_hidden` and `head_logits` are the pieces the proposer calls step by step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

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
        """[..., H (+ r)] -> probability [...] (float32)."""
        return torch.sigmoid(self.proj(x).float().squeeze(-1))


@dataclass
class DSparkRows:
    """The selected rows of one forward: hidden [N, H] (post-norm backbone), logits [N, V] (draft,
    Markov-corrected), confidence [N] float32 or None (no confidence head)."""

    hidden: Tensor
    logits: Tensor
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

    def head_logits(self, hidden: Tensor, prev_ids: Tensor) -> tuple[Tensor, Tensor | None]:
        """hidden [..., H], prev_ids [...] -> (draft logits [..., V], confidence [...] or None)."""
        base = self.logits(hidden)
        if self.markov_head is None:
            e = None
            out = base
        else:
            e = self.markov_head.features(prev_ids, hidden)
            out = base + self.markov_head.bias(e)
        conf = None
        if self.confidence_head is not None:
            conf_in = torch.cat([hidden, e], dim=-1) if e is not None and self.cfg.confidence_head_with_markov \
                else hidden
            conf = self.confidence_head(conf_in)
        return out, conf

    def forward(self, features: Tensor, block_ids: Tensor, anchors: Tensor, anchor_valid: Tensor,  # type: ignore[override]
                prev_ids: Tensor, select: Tensor) -> DSparkRows:
        """Backbone over the blocks, then the heads on the rows where `select` (bool [batch, nb, B])
        holds; prev_ids int64 [batch, nb, B] are the rows' Markov predecessors. Rows are in
        `select.nonzero()` order."""
        hidden = self.block_hidden(features, block_ids, anchors, anchor_valid)[select]  # [N, H]
        logits, conf = self.head_logits(hidden, prev_ids[select])
        return DSparkRows(hidden, logits, conf)
