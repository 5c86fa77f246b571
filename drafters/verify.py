"""Verification of a draft against the target: lossless speculative sampling (docs/design/algorithms.md section 0).

Chains: draft_ids int64 [k], draft_probs [k, V] or None (greedy drafting: q one-hot, as vLLM), target rows
[k + 1, V] (row k the bonus) -> (num_accepted, next_token). Trees (EAGLE-2): token_ids / parents int64 [N],
target rows [N + 1, V] (row 0 the root) -> (accepted path, next_token); deterministic top-k candidates are
tried in rank order with q one-hot (SafeAILab `evaluate_posterior`), a rejected one zeroed out of p, which
emits exactly the target's distribution (sampled candidates would need SpecInfer's scheme)."""

from __future__ import annotations

import torch
from torch import Tensor

from drafters.common.sampling import sample
from drafters.common.tree import tree_children


def _check(draft_ids: Tensor, target_rows: Tensor) -> int:
    k = draft_ids.numel()
    if target_rows.dim() != 2 or target_rows.shape[0] != k + 1:
        raise ValueError(f"target rows: got {tuple(target_rows.shape)}, expected ({k + 1}, V) for {k} draft tokens")
    return k


def verify_greedy(draft_ids: Tensor, target_logits: Tensor) -> tuple[int, int]:
    """Temperature 0: accept while draft == target argmax; emit the target argmax after."""
    k = _check(draft_ids, target_logits)
    target_ids = target_logits.argmax(-1)  # [k + 1]
    accepted = 0
    while accepted < k and int(draft_ids[accepted]) == int(target_ids[accepted]):
        accepted += 1
    return accepted, int(target_ids[accepted])


def recovered_distribution(target_probs: Tensor, draft_probs: Tensor | None, draft_id: int) -> Tensor:
    """norm(max(p - q, 0)) over [V]; with q one-hot at draft_id this is p with draft_id zeroed."""
    if draft_probs is None:
        residual = target_probs.clone()
        residual[draft_id] = 0.0
    else:
        residual = (target_probs - draft_probs).clamp_min(0.0)
    total = residual.sum()
    return residual / total if float(total) > 0 else target_probs


def verify_sampling(draft_ids: Tensor, draft_probs: Tensor | None, target_probs: Tensor,
                    generator: torch.Generator | None = None) -> tuple[int, int]:
    """Accept draft token x_i with probability min(1, p_i(x_i) / q_i(x_i)), left to right; at the
    first rejection sample from norm(max(p_i - q_i, 0)); if all are accepted sample the bonus
    from p_{k+1}. target_probs are after temperature / top-k / top-p (common/sampling.py)."""
    k = _check(draft_ids, target_probs)
    if draft_probs is not None and tuple(draft_probs.shape) != (k, target_probs.shape[1]):
        raise ValueError(f"draft_probs: got {tuple(draft_probs.shape)}, expected ({k}, {target_probs.shape[1]})")
    uniforms = torch.rand(k, generator=generator, dtype=torch.float64)
    for i in range(k):
        x = int(draft_ids[i])
        p = float(target_probs[i, x])
        q = 1.0 if draft_probs is None else float(draft_probs[i, x])
        if q > 0 and float(uniforms[i]) * q < p:  # u < p / q, i.e. accept with prob min(1, p/q)
            continue
        q_row = None if draft_probs is None else draft_probs[i]
        return i, int(sample(recovered_distribution(target_probs[i], q_row, x), generator))
    return k, int(sample(target_probs[k], generator))


def _check_tree(token_ids: Tensor, parents: Tensor, rows: Tensor) -> list[list[int]]:
    n = token_ids.numel()
    if parents.numel() != n or rows.dim() != 2 or rows.shape[0] != n + 1:
        raise ValueError(f"tree verify: {n} tokens, {parents.numel()} parents, target rows "
                         f"{tuple(rows.shape)}; expected ({n + 1}, V)")
    return tree_children(parents)


def verify_tree_greedy(token_ids: Tensor, parents: Tensor, target_logits: Tensor) -> tuple[list[int], int]:
    """Temperature 0: from the root, move to the child whose token is the target argmax of the
    current row while there is one; emit the target argmax of the row where the walk stops."""
    children = _check_tree(token_ids, parents, target_logits)
    target_ids = target_logits.argmax(-1)  # [N + 1]
    path: list[int] = []
    row = 0
    while True:
        want = int(target_ids[row])
        nxt = next((c for c in children[row] if int(token_ids[c]) == want), None)
        if nxt is None:
            return path, want
        path.append(nxt)
        row = 1 + nxt


def verify_tree_sampling(token_ids: Tensor, parents: Tensor, target_probs: Tensor,
                         generator: torch.Generator | None = None) -> tuple[list[int], int]:
    """Multi-candidate speculative sampling over a tree of deterministic candidates (module
    docstring). target_probs [N + 1, V] are after temperature / top-k / top-p."""
    children = _check_tree(token_ids, parents, target_probs)
    path: list[int] = []
    row = 0
    while True:
        p = target_probs[row].double()
        moved = False
        for c in children[row]:
            x = int(token_ids[c])
            if float(torch.rand((), generator=generator, dtype=torch.float64)) < float(p[x]):
                path.append(c)
                row, moved = 1 + c, True
                break
            p = recovered_distribution(p, None, x)
        if not moved:
            return path, int(sample(p, generator))
