"""Reference speculative decoder (pure torch, one sequence, recompute without KV cache): an HF-like target
(`.logits` [1, T, V], `.hidden_states`) and any `Proposer`; each round one target pass over
[x_0..x_n, d_1..d_k], verification (drafters/verify.py), the accepted drafts plus one target token. Greedy
mode reproduces greedy decoding exactly, sampling is lossless; stats follow vLLM's counters.
`tree_speculative_generate` (EAGLE-2) verifies a whole tree in one target pass under the tree mask."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor, nn

from drafters.common.contract import DraftContext, Proposer
from drafters.common.metrics import AcceptanceStats
from drafters.common.sampling import SamplingParams, logits_to_probs, sample
from drafters.common.tokens import cut_at_end
from drafters.common.tree import (
    TreeConfig,
    TreeProposer,
    additive_mask,
    build_draft_tree,
    tree_attention_mask,
    tree_position_ids,
)
from drafters.verify import verify_greedy, verify_sampling, verify_tree_greedy, verify_tree_sampling


@dataclass
class SpecDecodeResult:
    """token_ids: int64 [N] generated tokens (prompt excluded); stats: acceptance counters."""

    token_ids: Tensor
    stats: AcceptanceStats


@torch.no_grad()
def target_forward(target: nn.Module, token_ids: Tensor) -> tuple[Tensor, tuple[Tensor, ...]]:
    """token_ids [T] -> (logits [T, V] float32, hidden_states: L + 1 tensors [T, H])."""
    out = target(input_ids=token_ids[None], output_hidden_states=True)
    if out.hidden_states is None:
        raise ValueError("target: returned no hidden_states for output_hidden_states=True")
    return out.logits[0].float(), tuple(h[0] for h in out.hidden_states)


def _next_token(logits: Tensor, sampling: SamplingParams, generator: torch.Generator | None) -> int:
    if sampling.greedy:
        return int(logits.argmax())
    return int(sample(logits_to_probs(logits, sampling), generator))


def _finish(tokens: list[int], max_new_tokens: int, eos_token_id: int | None) -> Tensor:
    tokens, _ = cut_at_end(tokens[:max_new_tokens], () if eos_token_id is None else (eos_token_id,))
    return torch.tensor(tokens, dtype=torch.int64)


def _done(tokens: list[int], max_new_tokens: int, eos_token_id: int | None) -> bool:
    return len(tokens) >= max_new_tokens or (eos_token_id is not None and eos_token_id in tokens)


@torch.no_grad()
def autoregressive_generate(target: nn.Module, prompt_ids: Tensor, max_new_tokens: int,
                            sampling: SamplingParams | None = None, eos_token_id: int | None = None,
                            generator: torch.Generator | None = None) -> Tensor:
    """Plain decoding, one target pass per token (the baseline the decoder must reproduce)."""
    sampling = sampling or SamplingParams()
    seq, new = prompt_ids.long().clone(), list[int]()
    while not _done(new, max_new_tokens, eos_token_id):
        logits, _ = target_forward(target, seq)
        new.append(_next_token(logits[-1], sampling, generator))
        seq = torch.cat([seq, seq.new_tensor([new[-1]])])
    return _finish(new, max_new_tokens, eos_token_id)


@torch.no_grad()
def speculative_generate(target: nn.Module, proposer: Proposer, prompt_ids: Tensor, *,
                         num_speculative_tokens: int, max_new_tokens: int,
                         sampling: SamplingParams | None = None,
                         draft_sampling: Literal["greedy", "probabilistic"] = "greedy",
                         eos_token_id: int | None = None,
                         generator: torch.Generator | None = None) -> SpecDecodeResult:
    """Generate up to `max_new_tokens` tokens after `prompt_ids` [T0] with k-token chain drafts."""
    if num_speculative_tokens < 1 or max_new_tokens < 1 or prompt_ids.numel() < 1:
        raise ValueError(f"need num_speculative_tokens >= 1, max_new_tokens >= 1 and a non-empty prompt; got "
                         f"{num_speculative_tokens}, {max_new_tokens}, {prompt_ids.numel()} prompt tokens")
    if draft_sampling not in ("greedy", "probabilistic"):
        raise ValueError(f"draft_sampling: got {draft_sampling!r}, expected 'greedy' or 'probabilistic'")
    sampling = sampling or SamplingParams()
    draft_params = sampling if draft_sampling == "probabilistic" else SamplingParams()
    k = num_speculative_tokens
    committed = prompt_ids.long().cpu().clone()
    logits, hidden = target_forward(target, committed)
    new = [_next_token(logits[-1], sampling, generator)]
    committed = torch.cat([committed, committed.new_tensor(new)])
    stats = AcceptanceStats()
    while not _done(new, max_new_tokens, eos_token_id):
        n = committed.numel() - 1
        ctx = DraftContext(committed, tuple(h[:n] for h in hidden))
        proposal = proposer.propose(ctx, k, draft_params, generator)
        drafts = proposal.token_ids.long().cpu()
        if drafts.numel() != k:
            raise ValueError(f"proposer: returned {drafts.numel()} tokens, asked for {k}")
        logits, hidden = target_forward(target, torch.cat([committed, drafts]))
        rows = logits[n : n + k + 1]  # [k + 1, V]: row i scores drafts[i], row k is the bonus
        if sampling.greedy:
            accepted, nxt = verify_greedy(drafts, rows)
        else:
            q = None if proposal.probs is None else proposal.probs.float().cpu()
            accepted, nxt = verify_sampling(drafts, q, logits_to_probs(rows, sampling), generator)
        stats.record(k, accepted)
        emitted = [*drafts[:accepted].tolist(), nxt]
        new.extend(emitted)
        committed = torch.cat([committed, committed.new_tensor(emitted)])
    return SpecDecodeResult(_finish(new, max_new_tokens, eos_token_id), stats)


@torch.no_grad()
def target_tree_forward(target: nn.Module, token_ids: Tensor, mask: Tensor,
                        position_ids: Tensor) -> tuple[Tensor, tuple[Tensor, ...]]:
    """token_ids [T], mask bool [T, T], position_ids [T] -> (logits [T, V] float32, L + 1 hidden states
    [T, H]), the mask passed as a 4-D additive float mask [1, 1, T, T] (HF uses it unchanged)."""
    param = next(target.parameters(), None)
    dtype = param.dtype if param is not None and param.is_floating_point() else torch.float32
    device = param.device if param is not None else torch.device("cpu")
    out = target(input_ids=token_ids[None].to(device), attention_mask=additive_mask(mask, dtype).to(device),
                 position_ids=position_ids[None].to(device), output_hidden_states=True)
    if out.hidden_states is None:
        raise ValueError("target: returned no hidden_states for output_hidden_states=True")
    return out.logits[0].float().cpu(), tuple(h[0].cpu() for h in out.hidden_states)


@torch.no_grad()
def tree_speculative_generate(target: nn.Module, tree_proposer: TreeProposer, prompt_ids: Tensor, *,
                              top_k: int, depth: int, total_tokens: int, max_new_tokens: int,
                              sampling: SamplingParams | None = None, eos_token_id: int | None = None,
                              generator: torch.Generator | None = None) -> SpecDecodeResult:
    """Generate up to `max_new_tokens` after `prompt_ids` [T0] with EAGLE-2 dynamic-tree drafts (module
    docstring). Stats: one draft per round of tree-node count, accepted = path length."""
    cfg = TreeConfig(top_k, depth, total_tokens)
    if max_new_tokens < 1 or prompt_ids.numel() < 1:
        raise ValueError(f"need max_new_tokens >= 1 and a non-empty prompt; got {max_new_tokens}, "
                         f"{prompt_ids.numel()} prompt tokens")
    sampling = sampling or SamplingParams()
    committed = prompt_ids.long().cpu().clone()
    logits, hidden = target_forward(target, committed)
    hidden = tuple(h.cpu() for h in hidden)
    new = [_next_token(logits[-1].cpu(), sampling, generator)]
    committed = torch.cat([committed, committed.new_tensor(new)])
    stats = AcceptanceStats()
    while not _done(new, max_new_tokens, eos_token_id):
        n = committed.numel() - 1
        tree = build_draft_tree(tree_proposer, DraftContext(committed, tuple(h[:n] for h in hidden)), cfg)
        c = n + 1
        logits, hidden = target_tree_forward(target, torch.cat([committed, tree.token_ids]),
                                             tree_attention_mask(tree.parents, c), tree_position_ids(tree.depths, c))
        rows = logits[n:]  # [N + 1, V]: row 0 at the root x_n, row 1 + i at node i
        if sampling.greedy:
            path, nxt = verify_tree_greedy(tree.token_ids, tree.parents, rows)
        else:
            path, nxt = verify_tree_sampling(tree.token_ids, tree.parents, logits_to_probs(rows, sampling),
                                             generator)
        stats.record(tree.num_nodes, len(path), num_positions=cfg.depth)
        keep = torch.cat([torch.arange(c), c + torch.tensor(path, dtype=torch.int64)])  # committed rows
        hidden = tuple(h[keep] for h in hidden)
        emitted = [*tree.token_ids[path].tolist(), nxt]
        new.extend(emitted)
        committed = torch.cat([committed, committed.new_tensor(emitted)])
    return SpecDecodeResult(_finish(new, max_new_tokens, eos_token_id), stats)
