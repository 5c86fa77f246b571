"""Targets and drafters for the EAGLE-2 tree tests (tests/drafters/test_tree_decode.py).

- `MaskedTinyTarget`: `TinyTarget` that also takes HF's tree inputs: a 4-D additive float
  `attention_mask` [1, 1, T, T] (0 = attend) and `position_ids` [1, T].
- `PrevTokenTarget`: next-token logits table[prev, cur] where prev is the token the attention
  mask shows just before the current one (the visible key of highest position other than the
  query); a wrong tree mask or wrong positions change prev, so it is mask-sensitive, and its
  law is known in closed form (a trigram): x_{t+1} ~ softmax(table[x_{t-1}, x_t]).
- `TableTreeDrafter`: a `TreeProposer` whose next-token log-probs depend on the node's token
  only (log table[token]); hidden states are zeros.
- `TargetTreeDrafter`: an oracle `TreeProposer`: the target itself, run over [context; nodes]
  with the tree mask (greedy decoding must accept every depth).
- `hf_qwen3`: a tiny random transformers Qwen3ForCausalLM and its TargetHead.
"""

from __future__ import annotations

from typing import Any

import torch
from drafter_targets import TargetOutput, TinyTarget
from torch import Tensor, nn

from drafters.common.contract import DraftContext
from drafters.common.masks import dense_attention_mask, ttt_attention_mask
from drafters.common.target import TargetHead, TargetSpec
from drafters.common.tree import TreeExpansion, TreeNodes, tree_attention_mask, tree_position_ids
from drafters.spec_decode import target_tree_forward


def _visible(attention_mask: Tensor | None, t: int) -> Tensor:
    """bool [T, T] from HF inputs: causal when None, else the 4-D additive mask's zeros."""
    if attention_mask is None:
        return torch.ones(t, t, dtype=torch.bool).tril()
    return attention_mask[0, 0] == 0


class MaskedTinyTarget(TinyTarget):
    def forward(self, input_ids: Tensor, output_hidden_states: bool = False,  # type: ignore[override]
                attention_mask: Tensor | None = None, position_ids: Tensor | None = None) -> TargetOutput:
        b, t = input_ids.shape
        pos = torch.arange(t).expand(b, t) if position_ids is None else position_ids
        mask = (ttt_attention_mask(torch.ones(b, t, dtype=torch.bool), 0) if attention_mask is None
                else dense_attention_mask(_visible(attention_mask, t), b))
        h = self.embed_tokens(input_ids)
        states = [h]
        for i, layer in enumerate(self.layers):
            h, _ = layer(h, pos, mask, None, "sdpa")
            states.append(self.norm(h) if i == len(self.layers) - 1 else h)
        return TargetOutput(self.lm_head(self.norm(h)), tuple(states) if output_hidden_states else None)


class PrevTokenTarget(nn.Module):
    """table: [V + 1, V, V] logits; table[V] is used when no earlier token is visible (BOS)."""

    def __init__(self, table: Tensor):
        super().__init__()
        self.table = table
        self.vocab = table.shape[1]

    def forward(self, input_ids: Tensor, output_hidden_states: bool = False, attention_mask: Tensor | None = None,
                position_ids: Tensor | None = None) -> TargetOutput:
        ids = input_ids[0]
        t = ids.numel()
        pos = torch.arange(t) if position_ids is None else position_ids[0]
        others = _visible(attention_mask, t) & ~torch.eye(t, dtype=torch.bool)
        score = torch.where(others, pos[None, :], torch.full((t, t), -1))  # [T, T]
        best, idx = score.max(-1)
        prev = torch.where(best >= 0, ids[idx], torch.full_like(ids, self.vocab))
        logits = self.table[prev, ids][None]  # [1, T, V]
        h = torch.nn.functional.one_hot(input_ids, self.vocab).float()
        return TargetOutput(logits, (h, h) if output_hidden_states else None)


class TableTreeDrafter:
    """log_probs(node) = log table[node token]; the root's = log table[last committed token]."""

    def __init__(self, table: Tensor):
        self.log_table = table.log()
        self.calls: list[TreeNodes] = []

    def expand(self, ctx: DraftContext, nodes: TreeNodes) -> TreeExpansion:
        self.calls.append(nodes)
        tokens = torch.cat([ctx.token_ids[-1:], nodes.token_ids])
        return TreeExpansion(self.log_table[tokens].float(), torch.zeros(tokens.numel(), 1))


class TargetTreeDrafter:
    def __init__(self, target: nn.Module):
        self.target = target

    def expand(self, ctx: DraftContext, nodes: TreeNodes) -> TreeExpansion:
        c = ctx.token_ids.numel()
        logits, _ = target_tree_forward(self.target, torch.cat([ctx.token_ids, nodes.token_ids]),
                                        tree_attention_mask(nodes.parents, c), tree_position_ids(nodes.depths, c))
        rows = logits[c - 1:]  # [N + 1, V]: x_n (the root), then the nodes
        return TreeExpansion(torch.log_softmax(rows, -1), torch.zeros(rows.shape[0], 1))


def hf_qwen3(vocab: int = 32, layers: int = 4, attn: str = "sdpa", seed: int = 0,
             peak: float = 8.0) -> tuple[nn.Module, TargetHead]:
    """peak scales the LM head (HF's init gives near-flat distributions: greedy near-ties)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=32, num_hidden_layers=layers, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, intermediate_size=64, max_position_embeddings=256,
                      tie_word_embeddings=False)
    cfg._attn_implementation = attn  # "sdpa" or "eager": both must take the 4-D additive tree mask
    model = Qwen3ForCausalLM(cfg).eval()
    assert model.config._attn_implementation == attn
    with torch.no_grad():
        model.lm_head.weight.mul_(peak)
    raw: dict[str, Any] = cfg.to_dict()
    spec = TargetSpec.from_hf_config(raw)
    head = TargetHead(spec, model.model.embed_tokens.weight, model.lm_head.weight, model.model.norm.weight)
    return model, head
