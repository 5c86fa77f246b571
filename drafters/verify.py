"""Verification of a draft against the target: lossless speculative sampling (algorithms.md 0).

Shapes: draft_ids int64 [k] (target ids); draft_probs float [k, V] or None (greedy drafting:
q is one-hot at the draft token, as vLLM does with draft_probs=None); target rows [k + 1, V]
where row i scores draft token i (0-based) and row k is the bonus position.
Each function returns (num_accepted in 0..k, next_token): the first num_accepted draft tokens
are kept, then next_token (recovered at the first rejection, else the bonus) is emitted.
"""

from __future__ import annotations

import torch
from torch import Tensor

from drafters.common.sampling import sample


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
