"""P-EAGLE parallel drafting for the reference decoder, as vLLM's parallel-drafting EAGLE-3 does it
(docs/design/engines.md section 2.3.1): ONE causal forward over the n EAGLE-3 rows plus K - 1 mask rows,
the training layout of one chain at anchor n - 1 (`cod.chain_layout`); K <= `num_depths`."""

from __future__ import annotations

import torch

from drafters.common.contract import DraftContext, Proposal
from drafters.common.sampling import SamplingParams
from drafters.common.vocab import draft_logits_to_target
from drafters.eagle3.proposer import AuxProposer
from drafters.peagle.cod import chain_layout
from drafters.peagle.model import PEagleModel


class PEagleProposer(AuxProposer[PEagleModel]):

    @torch.no_grad()
    def draft_logits(self, ctx: DraftContext, num_tokens: int) -> torch.Tensor:
        """float32 [K, V] target-vocab draft logits of the K slots of one forward."""
        if not 1 <= num_tokens <= self.model.cfg.num_depths:
            raise ValueError(f"propose: num_tokens {num_tokens}, expected 1..num_depths={self.model.cfg.num_depths} "
                             "(the depths P-EAGLE was trained on)")
        aux = ctx.features(self.aux_layer_ids, "propose")  # [n, k*H_t]
        ids, n = ctx.token_ids, aux.shape[0]
        model = self.model
        device = model.fc.weight.device
        layout = chain_layout(n, num_tokens, device)  # sequence x_0..x_n: row a reads x_{a+1}
        aux = torch.cat([aux, aux.new_zeros(1, aux.shape[1])])  # x_n has no features (no element reads them)
        hidden = model(ids[None].to(device), aux.to(device)[None], layout)  # [1, n + K - 1, H]
        rows = hidden[0, n - 1:]  # [K, H]: row n - 1, then the K - 1 mask slots
        return draft_logits_to_target(model.lm_head(rows).float(), model.d2t, model.spec.vocab_size)

    @torch.no_grad()
    def propose(self, ctx: DraftContext, num_tokens: int, sampling: SamplingParams,
                generator: torch.Generator | None = None) -> Proposal:
        return Proposal.drawn(self.draft_logits(ctx, num_tokens), sampling, generator)  # [K, V]: independent slots
