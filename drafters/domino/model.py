"""Domino draft: the DFlash backbone + a causal GRU correction head (docs/design/algorithms.md section 6).
For one block [x_a, MASK x (B - 1)], post-norm hidden h_k and the tokens t_0 = x_a, t_1, ... before each
draft (labels in training, drafts at inference):
    U_k = target_lm_head(h_k)                               # [V] base logits, slot k -> x_{a+k+1}
    g_k = GRU(target_embed_tokens[t_0 .. t_k]) output at step k   # [G]
    final_0 = U_0; final_k = U_k + embed_proj([h_k ; g_k])  # k >= 1 (pure_draft_prefix_len = 1)"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from drafters.common.target import TargetHead
from drafters.dflash.model import DFlashDraft
from drafters.domino.config import DominoConfig


class DominoDraft(DFlashDraft):
    """`cfg` is resolved against `target.spec` (the backbone's rules), then the head is built."""

    cfg: DominoConfig

    def __init__(self, cfg: DominoConfig, target: TargetHead):
        super().__init__(cfg, target)
        h, v = target.spec.hidden_size, target.spec.vocab_size
        g, e = cfg.gru_hidden_dim, cfg.emb_dim
        self.prefix_gru = nn.GRU(h, g, num_layers=1, batch_first=True, bias=False)
        self.embed_proj = nn.Sequential(nn.Linear(h + g, e, bias=False), nn.SiLU(), nn.Linear(e, v, bias=False))

    def gru_states(self, prev_ids: Tensor, state: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """prev_ids int64 [N, T] (t_0 .. t_{T-1} per row) -> (g [N, T, G] outputs, final state
        [1, N, G]); `state` [1, N, G] continues an earlier call (the proposer's step-by-step rollout)."""
        x = self.target_embed_tokens[prev_ids].to(self.fc.weight.dtype)  # [N, T, H]
        out, last = self.prefix_gru(x, state)
        return out, last

    def correction(self, hidden: Tensor, gru: Tensor) -> Tensor:
        """hidden [..., H], gru [..., G] -> the additive correction [..., V]."""
        return self.embed_proj(torch.cat([hidden, gru.to(hidden.dtype)], dim=-1))

    def row_logits(self, hidden: Tensor, gru: Tensor, slot: Tensor,
                   head: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """hidden [n, H], gru [n, G], slot int64 [n] -> (base logits U [n, V], final logits [n, V]); slot 0
        keeps U (pure_draft_prefix_len = 1)."""
        base = self.logits(hidden, head)  # [n, V]
        corrected = (slot >= 1)[:, None]  # [n, 1]
        return base, torch.where(corrected, base + self.correction(hidden, gru), base)

    def forward(self, features: Tensor, block_ids: Tensor, anchors: Tensor,  # type: ignore[override]
                anchor_valid: Tensor, prev_ids: Tensor, select: Tensor) -> tuple[Tensor, Tensor]:
        """Teacher-forced forward over the B - 1 drafting slots where `select` (bool [batch, nb, B - 1])
        holds, prev_ids int64 [batch, nb, B - 1] -> (post-norm hidden [N, H], GRU outputs [N, G])."""
        batch, nb, bs = block_ids.shape
        if tuple(prev_ids.shape) != (batch, nb, bs - 1) or tuple(select.shape) != (batch, nb, bs - 1):
            raise ValueError(f"prev_ids {tuple(prev_ids.shape)} / select {tuple(select.shape)}: expected "
                             f"{(batch, nb, bs - 1)} (the B - 1 drafting slots)")
        hidden = self.block_hidden(features, block_ids, anchors, anchor_valid)[:, :, : bs - 1]  # [batch, nb, B-1, H]
        gru, _ = self.gru_states(prev_ids.reshape(batch * nb, bs - 1))  # [batch*nb, B-1, G]
        gru = gru.view(batch, nb, bs - 1, -1)
        return hidden[select], gru[select]  # [N, H], [N, G]
