"""EAGLE-3 chain drafting for the reference decoder, as vLLM's EAGLE-3 proposer does it.

Round with committed tokens x_0..x_n and target features at positions 0..n-1:
  1. prefill: rows t = 0..n-1 pair embed(x_{t+1}) with fc(cat aux f_t); the last row's logits
     give draft token d_1 (the token after x_n);
  2. step i >= 2: embed(d_{i-1}) with the previous step's PRE-norm hidden (no fc) at the next
     position, attending to every earlier key (prefix rows + earlier steps of this row).
Recomputed from scratch each round (no draft KV cache across rounds): same numbers, simpler.

Tree drafting (`expand`, the `TreeProposer` protocol of drafters/common/tree.py, EAGLE-2): one
forward over [prefix rows 0..n-1; tree nodes], each node row pairing embed(token) with its
parent's PRE-norm hidden (no fc), at position n + depth - 1, attending to the prefix rows, its
ancestors and itself: the chain step above, with the earlier steps replaced by the ancestors.
"""

from __future__ import annotations

import torch

from drafters.common.contract import DraftContext, Proposal
from drafters.common.masks import dense_attention_mask
from drafters.common.sampling import ChainDraws, SamplingParams
from drafters.common.tree import TreeExpansion, TreeNodes, tree_attention_mask, tree_position_ids
from drafters.common.vocab import draft_logits_to_target
from drafters.eagle3.model import Eagle3Model


def aux_features(ctx: DraftContext, layer_ids: tuple[int, ...]) -> torch.Tensor:
    """cat of the target hidden states at `layer_ids` (internal ids): [n, k*H_t]."""
    num = len(ctx.target_hidden_states)
    for i in layer_ids:
        if not 0 <= i < num:
            raise ValueError(f"aux layer id {i}: the context has {num} hidden states (0..{num - 1})")
    return torch.cat([ctx.target_hidden_states[i] for i in layer_ids], dim=-1)


class Eagle3Proposer:
    def __init__(self, model: Eagle3Model):
        self.model = model
        assert model.cfg.aux_layer_ids is not None
        self.aux_layer_ids: tuple[int, ...] = model.cfg.aux_layer_ids

    @torch.no_grad()
    def propose(self, ctx: DraftContext, num_tokens: int, sampling: SamplingParams,
                generator: torch.Generator | None = None) -> Proposal:
        ids = ctx.token_ids
        n = ids.numel() - 1
        if n < 1 or num_tokens < 1:
            raise ValueError(f"propose: need >= 2 committed tokens and num_tokens >= 1, got {n + 1} and {num_tokens}")
        aux = aux_features(ctx, self.aux_layer_ids)
        if aux.shape[0] != n:
            raise ValueError(f"target_hidden_states: {aux.shape[0]} positions, expected {n} (tokens 0..n-1)")
        model = self.model
        device = model.fc.weight.device
        state = model.prefill(ids[1:].to(device)[None], aux.to(device)[None])
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
        ids = ctx.token_ids
        n = ids.numel() - 1
        if n < 1:
            raise ValueError(f"expand: need >= 2 committed tokens, got {n + 1}")
        aux = aux_features(ctx, self.aux_layer_ids)
        if aux.shape[0] != n:
            raise ValueError(f"target_hidden_states: {aux.shape[0]} positions, expected {n} (tokens 0..n-1)")
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
