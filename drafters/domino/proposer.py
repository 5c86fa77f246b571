"""Domino block drafting for the reference decoder, as SGLang's greedy Domino rollout does it
(docs/design/engines.md section 4.6): ONE backbone forward over the full block, then d_1 from U_0 and
d_{k+1} from U_k + embed_proj([h_k ; g_k]) step by step (K <= B - 1), each q reported (lossless)."""

from __future__ import annotations

import torch

from drafters.common.contract import DraftContext, Proposal
from drafters.common.sampling import ChainDraws, SamplingParams
from drafters.dflash.proposer import BlockProposer
from drafters.domino.model import DominoDraft


class DominoProposer(BlockProposer[DominoDraft]):
    @torch.no_grad()
    def propose(self, ctx: DraftContext, num_tokens: int, sampling: SamplingParams,
                generator: torch.Generator | None = None) -> Proposal:
        model = self.model
        hidden = self.round_hidden(ctx, num_tokens, model.cfg.block_size)  # [B, H]: always the full block
        ids, device = ctx.token_ids, hidden.device
        prev = ids[-1].to(device).view(1, 1)  # t_0 = x_n
        g, state = model.gru_states(prev)  # g_0 (slot 0 does not use it)
        draws = ChainDraws(sampling, generator)
        for k in range(num_tokens):
            logits = model.logits(hidden[k : k + 1])  # [1, V]
            if k >= 1:
                logits = logits + model.correction(hidden[k : k + 1], g[:, -1])
            token = draws.draw(logits[0])
            if k + 1 < num_tokens:
                g, state = model.gru_states(token.view(1, 1), state)  # g_{k+1}: after t_{k+1} = d_{k+1}
        return Proposal(*draws.stacked())
