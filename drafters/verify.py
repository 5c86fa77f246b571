"""Verification of a draft against the target: lossless speculative sampling (docs/design/algorithms.md section 0).

Shapes: draft_ids int64 [k] (target ids); draft_probs float [k, V] or None (greedy drafting:
q is one-hot at the draft token, as vLLM does with draft_probs=None); target rows [k + 1, V]
where row i scores draft token i (0-based) and row k is the bonus position.
Each function returns (num_accepted in 0..k, next_token): the first num_accepted draft tokens
are kept, then next_token (recovered at the first rejection, else the bonus) is emitted.

Trees (EAGLE-2, drafters/common/tree.py): token_ids / parents int64 [N]; target rows [N + 1, V],
row 0 at the root x_n (scores the root's children), row 1 + i at node i (scores its children,
or is the bonus row when the walk ends at node i). The walk starts at the root; it returns
(path: accepted node indices root-to-node, next_token). Sampling scheme, multi-candidate
speculative sampling with DETERMINISTIC candidates (EAGLE-2's top-k children; SafeAILab
`evaluate_posterior`): at a node with target distribution p, try its children c_1, c_2, ... in
node order (rank order); q is one-hot at the child being tried, so child token x is accepted with
probability min(1, p(x)/1) = p(x); after a rejection p <- norm(max(p - onehot(x), 0)), i.e. p
with x zeroed and renormalised (`recovered_distribution` with q one-hot); accepting a child moves the walk there (its own row);
when every child is rejected (or the node is a leaf) next_token is drawn from the current p.
Lossless: by induction over the children, token x_j is emitted with probability
prod_{i<j}(1 - p_i(x_i)) * p_j(x_j) = p(x_j) (p_j is p with x_1..x_{j-1} removed), and any
other token y with prod_i (1 - p_i(x_i)) * p_m(y) = p(y); so each step emits exactly the
target's distribution at that position, and the next step conditions on what was emitted.
(Candidates SAMPLED from q with or without replacement would need SpecInfer's / the recursive
rejection scheme with the real q; this decoder drafts trees by top-k only.)
"""

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
