"""EAGLE-1 chain drafting for the reference decoder, as vLLM's EAGLE proposer does it: prefill rows pair
embed(x_{t+1}) with f_t, then each step pairs embed(d_{i-1}) with the previous step's OWN predicted
feature (n = 3: (x1, f0), (x2, f1), (x3, f2) -> f^_3 -> d_1; (d_1, f^_3) at position 3 -> d_2).
`expand` (EAGLE-2) pairs each node's token with its parent's predicted feature under the tree mask."""

from __future__ import annotations

import torch

from drafters.common.contract import DraftContext, Proposal
from drafters.common.masks import dense_attention_mask
from drafters.common.sampling import ChainDraws, SamplingParams
from drafters.common.tree import TreeExpansion, TreeNodes, tree_attention_mask, tree_position_ids
from drafters.eagle1.model import Eagle1Model


def _features(ctx: DraftContext, caller: str) -> torch.Tensor:
    """The EAGLE-1 feature of positions 0..n-1: [n, H], post-final-norm (HF hidden_states[L], the last)."""
    return ctx.features((len(ctx.target_hidden_states) - 1,), caller)


class Eagle1Proposer:
    def __init__(self, model: Eagle1Model):
        self.model = model

    @torch.no_grad()
    def propose(self, ctx: DraftContext, num_tokens: int, sampling: SamplingParams,
                generator: torch.Generator | None = None) -> Proposal:
        if num_tokens < 1:
            raise ValueError(f"propose: num_tokens {num_tokens}, expected >= 1")
        features = _features(ctx, "propose")
        model = self.model
        device = model.fc.weight.device
        state = model.prefill(ctx.token_ids[1:].to(device)[None], features.to(device)[None])
        draws = ChainDraws(sampling, generator)
        for i in range(num_tokens):
            token = draws.draw(state.logits[0].float())  # from [V], the target vocab
            if i + 1 < num_tokens:
                state = model.step(state, token.view(1))
        return Proposal(*draws.stacked())

    @torch.no_grad()
    def expand(self, ctx: DraftContext, nodes: TreeNodes) -> TreeExpansion:
        """Draft log-probs [N + 1, V] and predicted features [N + 1, H] of the root (row 0: the
        prefix's last row, which predicts the token after x_n) and of every node."""
        features = _features(ctx, "expand")
        n = features.shape[0]
        model = self.model
        device, dtype = model.fc.weight.device, model.fc.weight.dtype
        features = features.to(device, dtype)  # [n, H]
        tokens = ctx.token_ids[1:].to(device)
        if nodes.num_nodes:
            features = torch.cat([features, nodes.parent_hidden.to(device, dtype)])  # [n + N, H]
            tokens = torch.cat([tokens, nodes.token_ids.to(device)])
        mask = dense_attention_mask(tree_attention_mask(nodes.parents, n).to(device))  # compiled flex reads it on the device
        pos = tree_position_ids(nodes.depths, n).to(device)
        out, _ = model._draft(tokens[None], features[None], pos[None], mask, None)
        rows = out[0, n - 1:]  # [N + 1, H]
        return TreeExpansion(torch.log_softmax(model.head_logits(rows).float(), -1).cpu(), rows.cpu())
