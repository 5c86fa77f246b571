"""DSpark block drafting for the reference decoder (docs/design/algorithms.md section 5): ONE backbone
forward over [x_n, MASK x (K - 1)] gives U_1..U_K; then d_k ~ softmax((U_k + W2 e(d_{k-1}, h_k)) / T) left
to right (greedy: argmax), each q_k reported (lossless)."""

from __future__ import annotations

import torch

from drafters.common.contract import DraftContext, Proposal
from drafters.common.sampling import ChainDraws, SamplingParams
from drafters.dflash.proposer import BlockProposer
from drafters.dspark.model import DSparkDraft


class DSparkProposer(BlockProposer[DSparkDraft]):
    anchor_rows = 0  # every slot drafts: the anchor predicts the first new token

    @torch.no_grad()
    def propose(self, ctx: DraftContext, num_tokens: int, sampling: SamplingParams,
                generator: torch.Generator | None = None) -> Proposal:
        model = self.model
        hidden = self.round_hidden(ctx, num_tokens, num_tokens)  # [K, H]
        ids, device = ctx.token_ids, hidden.device
        prev = ids[-1].to(device).view(1)
        draws = ChainDraws(sampling, generator)
        for k in range(num_tokens):
            logits, _ = model.head_logits(hidden[k : k + 1], prev)  # [1, V]
            prev = draws.draw(logits[0]).view(1)
        return Proposal(*draws.stacked())
