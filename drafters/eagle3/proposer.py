"""EAGLE-3 chain drafting for the reference decoder, as vLLM's EAGLE-3 proposer does it: prefill rows pair
embed(x_{t+1}) with fc(aux f_t); each step pairs embed(d_{i-1}) with the previous step's pre-norm hidden.
`expand` (EAGLE-2) pairs each node's token with its parent's pre-norm hidden under the tree mask."""

from __future__ import annotations

from typing import Any, Generic, TypeVar

import torch

from drafters.common.contract import DraftContext, Proposal
from drafters.common.masks import dense_attention_mask
from drafters.common.sampling import ChainDraws, SamplingParams
from drafters.common.tree import TreeExpansion, TreeNodes, tree_attention_mask, tree_position_ids
from drafters.common.vocab import draft_logits_to_target
from drafters.eagle3.model import Eagle3Backbone, Eagle3Model

M = TypeVar("M", bound=Eagle3Backbone[Any])


class AuxProposer(Generic[M]):
    """What the EAGLE-3 and P-EAGLE proposers share: the model and its resolved aux layer ids
    (internal: HF hidden_states indices), read by `ctx.features` at the start of a round."""

    def __init__(self, model: M):
        self.model = model
        assert model.cfg.aux_layer_ids is not None
        self.aux_layer_ids: tuple[int, ...] = model.cfg.aux_layer_ids


class Eagle3Proposer(AuxProposer[Eagle3Model]):

    @torch.no_grad()
    def propose(self, ctx: DraftContext, num_tokens: int, sampling: SamplingParams,
                generator: torch.Generator | None = None) -> Proposal:
        if num_tokens < 1:
            raise ValueError(f"propose: num_tokens {num_tokens}, expected >= 1")
        aux = ctx.features(self.aux_layer_ids, "propose")  # [n, k*H_t]
        model = self.model
        device = model.fc.weight.device
        state = model.prefill(ctx.token_ids[1:].to(device)[None], aux.to(device)[None])
        draws = ChainDraws(sampling, generator)
        for i in range(num_tokens):
            logits = draft_logits_to_target(state.logits[0].float(), model.d2t, model.spec.vocab_size)  # [V]
            token = draws.draw(logits)
            if i + 1 < num_tokens:
                state = model.step(state, token.view(1))
        return Proposal(*draws.stacked())

    @torch.no_grad()
    def expand(self, ctx: DraftContext, nodes: TreeNodes) -> TreeExpansion:
        """Draft log-probs [N + 1, V] (target vocab) and pre-norm hidden [N + 1, H] of the root
        (row 0: the prefix's last row, which predicts the token after x_n) and of every node."""
        aux = ctx.features(self.aux_layer_ids, "expand")  # [n, k*H_t]
        ids, n = ctx.token_ids, aux.shape[0]
        model = self.model
        device = model.fc.weight.device
        h = model.fc(aux.to(device, model.fc.weight.dtype))  # [n, H]
        tokens = ids[1:].to(device)
        if nodes.num_nodes:
            h = torch.cat([h, nodes.parent_hidden.to(device, h.dtype)])  # [n + N, H]
            tokens = torch.cat([tokens, nodes.token_ids.to(device)])
        mask = dense_attention_mask(tree_attention_mask(nodes.parents, n).to(device))  # compiled flex reads it on the device
        pos = tree_position_ids(nodes.depths, n).to(device)
        out, _ = model._layers(model.embed_tokens(tokens)[None], h[None], pos[None], mask, None)
        rows = out[0, n - 1:]  # [N + 1, H]
        logits = draft_logits_to_target(model.lm_head(model.norm(rows)).float(), model.d2t, model.spec.vocab_size)
        return TreeExpansion(torch.log_softmax(logits, -1).cpu(), rows.cpu())
