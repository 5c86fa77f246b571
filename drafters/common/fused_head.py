"""Fused head + loss paths (issue 21): each chunk's [n, V] logits are used once, in the forward, which keeps
the gradient the backward only scales (no recompute): `frozen_head_ce_rows` (DFlash), `fused_head_loss`
(DSpark, EAGLE-1: frozen head plus optional low-rank bias B [r, V]) and `soft_ce_head_rows` (EAGLE-3 /
P-EAGLE's trainable draft-vocab head). Valid because a row's loss depends on that row only."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from drafters.common.chunked_head import (
    check_chunk_rows,
    chunk_bounds,
    hard_ce_grad_rows,
    row_argmax,
    soft_ce_grad_rows,
    synced_chunk_bounds,
    topk_ids,
    wide_float,
)

RowLoss = Callable[[Tensor, Tensor, int, int], tuple[Tensor, tuple[Tensor, ...]]]


def bias_matrix(linear: nn.Module, rank: int, like: Tensor) -> Tensor:
    """B [r, V] with linear(e) = e @ B: the bias-free Linear(r -> V) applied to the identity [r, r], one
    module call, so under FSDP its forward gathers the weight and its backward reduce-scatters d B."""
    return linear(torch.eye(rank, dtype=like.dtype, device=like.device))


class _FusedHeadLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, hidden: Tensor, target_hidden: Tensor,  # type: ignore[override]
                weight: Tensor, target_weight: Tensor, markov: Tensor | None, bias: Tensor | None,
                row_loss: RowLoss, chunk_rows: int, needs_grad: bool) -> tuple[Tensor, ...]:
        n = int(hidden.shape[0])
        d_hidden = torch.zeros_like(hidden)
        d_markov = None if markov is None else torch.zeros_like(markov)
        d_bias = None if bias is None else torch.zeros(bias.shape, dtype=torch.promote_types(bias.dtype, torch.float32),
                                                       device=bias.device)
        total = hidden.new_zeros((), dtype=torch.promote_types(hidden.dtype, torch.float32))
        outs: list[tuple[Tensor, ...]] = []
        for start, stop in chunk_bounds(n, chunk_rows):
            z = hidden[start:stop] @ weight.T  # [n, V], under the caller's autocast as the unfused path
            if markov is not None and bias is not None:
                z = z + markov[start:stop] @ bias
            target = target_hidden[start:stop] @ target_weight.T  # [n, V]
            z_dtype = z.dtype
            with torch.enable_grad():
                leaf = wide_float(z.detach()).requires_grad_(needs_grad)  # one float32 copy for all row terms
                loss, out = row_loss(leaf, target, start, stop)
            del target, z
            total = total + loss.detach()
            outs.append(tuple(o.detach() for o in out))
            if not needs_grad:
                continue
            (dz,) = torch.autograd.grad(loss, [leaf], allow_unused=True, materialize_grads=True)
            dz = dz.to(z_dtype)  # as autograd through z: d z in z's dtype (bf16 under autocast) for the matmuls
            del loss
            d_hidden[start:stop] = (dz @ weight).to(hidden.dtype)  # [n, H]
            if d_markov is not None and d_bias is not None and markov is not None and bias is not None:
                d_markov[start:stop] = (dz @ bias.T).to(markov.dtype)  # [n, r]
                d_bias += (markov[start:stop].T.to(dz.dtype) @ dz).to(d_bias.dtype)  # [r, V]
            del dz, leaf
        if d_markov is not None and d_bias is not None and bias is not None:
            ctx.save_for_backward(d_hidden, d_markov, d_bias.to(bias.dtype))
        else:
            ctx.save_for_backward(d_hidden)
        per_row = tuple(torch.cat(parts) for parts in zip(*outs, strict=True))
        ctx.mark_non_differentiable(*per_row)
        return (total, *per_row)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad_total: Tensor,  # type: ignore[override]
                 *grad_rows: Tensor | None) -> tuple[Tensor | None, ...]:
        saved = ctx.saved_tensors  # type: ignore[attr-defined]  # d hidden[, d markov, d bias]
        scale = wide_float(grad_total)  # scaled in float32 at least: the scale is not rounded to bf16
        grads = [(scale * wide_float(g)).to(g.dtype) for g in saved] + [None, None]
        return (grads[0], None, None, None, grads[1], grads[2], None, None, None)


def fused_head_loss(hidden: Tensor, target_hidden: Tensor, weight: Tensor, target_weight: Tensor,
                    markov: Tensor | None, bias: Tensor | None, row_loss: RowLoss,
                    chunk_rows: int) -> tuple[Tensor, tuple[Tensor, ...]]:
    """(sum over chunks of row_loss(z, t, start, stop)[0], per-row outputs concatenated): hidden [N, H] and
    markov [N, r] may need grad, target_hidden [N, H] does not, weight [V, H] is the FROZEN head, bias
    B [r, V] or None; z [n, V] is a float32 leaf and the loss must depend on it row-wise only."""
    check_chunk_rows(chunk_rows)
    if weight.requires_grad or target_weight.requires_grad:
        raise ValueError("fused_head_loss: the head weight must not require grad (frozen head only)")
    if (markov is None) != (bias is None):
        raise ValueError("fused_head_loss: markov and bias go together (both or neither)")
    if int(target_hidden.shape[0]) != int(hidden.shape[0]):
        raise ValueError(f"rows: hidden {int(hidden.shape[0])} vs target_hidden {int(target_hidden.shape[0])}")
    needs_grad = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (hidden, markov, bias))
    total, *per_row = _FusedHeadLoss.apply(hidden, target_hidden.detach(), weight, target_weight, markov, bias, row_loss,
                                           chunk_rows, needs_grad)
    return total, tuple(per_row)


class _SoftCE(torch.autograd.Function):
    """Soft CE of logits [n, Vd] against target probabilities [n, Vd] (no grad): the forward keeps d CE_i /
    d logits_i (`soft_ce_grad_rows`) in the logits' dtype; the backward scales it by the per-row gradient."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, logits: Tensor,  # type: ignore[override]
                probs: Tensor) -> Tensor:
        ce, grad = soft_ce_grad_rows(logits, probs)
        ctx.save_for_backward(grad.to(logits.dtype))
        return ce

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx,  # type: ignore[override]
                 grad_ce: Tensor) -> tuple[Tensor | None, None]:
        (grad,) = ctx.saved_tensors  # type: ignore[attr-defined]
        return (wide_float(grad_ce)[:, None] * wide_float(grad)).to(grad.dtype), None  # no bf16 rounding of the scale


def soft_ce_head_rows(head: Callable[[Tensor], Tensor], hidden: Tensor, probs: Tensor, prob_rows: Tensor,
                      chunk_rows: int) -> tuple[Tensor, Tensor]:
    """hidden [N, H], head (trainable, called once per chunk), probs [P, Vd] (no grad), prob_rows int64 [N]
    -> (soft CE [N] of head(hidden) against probs[prob_rows], argmax [N]); differentiable in hidden and head."""
    check_chunk_rows(chunk_rows)
    if int(prob_rows.shape[0]) != int(hidden.shape[0]):
        raise ValueError(f"rows: hidden {int(hidden.shape[0])} vs prob_rows {int(prob_rows.shape[0])}")
    ces, args = [], []
    for start, stop in synced_chunk_bounds(int(hidden.shape[0]), chunk_rows):
        logits = head(hidden[start:stop])  # [n, Vd]
        ces.append(_SoftCE.apply(logits, probs[prob_rows[start:stop]]) if torch.is_grad_enabled()
                   else soft_ce_grad_rows(logits, probs[prob_rows[start:stop]])[0])
        args.append(row_argmax(logits))
        del logits
    return torch.cat(ces), torch.cat(args)


class _FrozenHeadCE(torch.autograd.Function):
    """`frozen_head_ce_rows`: forward runs the chunks and keeps d CE_i / d hidden_i [N, H]; backward
    scales it by the incoming per-row gradient (CE_i depends on row i only; the head is frozen)."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, hidden: Tensor, weight: Tensor, labels: Tensor,
                chunk_rows: int, top_k: int) -> tuple[Tensor, Tensor]:  # type: ignore[override]
        ces, tops, grads = [], [], []
        for start, stop in chunk_bounds(int(hidden.shape[0]), chunk_rows):
            h = hidden[start:stop]
            logits = h @ weight.T  # [n, V], under the caller's autocast as the unfused path
            ce, dlogits = hard_ce_grad_rows(logits, labels[start:stop])
            tops.append(topk_ids(logits, top_k))
            logits_dtype = logits.dtype
            del logits
            # as the unfused backward: d logits cast to the logits' dtype, times the head, to hidden's dtype
            grads.append((dlogits.to(logits_dtype) @ weight).to(hidden.dtype))  # [n, H]
            ces.append(ce)
            del dlogits
        ce_all, top_all, grad_all = torch.cat(ces), torch.cat(tops), torch.cat(grads)
        ctx.save_for_backward(grad_all)
        ctx.mark_non_differentiable(top_all)
        return ce_all, top_all

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad_ce: Tensor,  # type: ignore[override]
                 grad_top: Tensor | None) -> tuple[Tensor | None, ...]:
        (grad_all,) = ctx.saved_tensors  # type: ignore[attr-defined]
        if grad_ce is None:
            return None, None, None, None, None
        return (grad_ce[:, None].to(grad_all.dtype) * grad_all), None, None, None, None


def frozen_head_ce_rows(hidden: Tensor, weight: Tensor, labels: Tensor, chunk_rows: int,
                        top_k: int) -> tuple[Tensor, Tensor]:
    """hidden [N, H], a FROZEN head weight [V, H], labels int64 [N] -> (CE [N], top-`top_k` ids [N, k]),
    `chunk_rows` at a time, keeping d CE / d hidden = (softmax - onehot) @ weight from the forward."""
    check_chunk_rows(chunk_rows)
    if int(labels.shape[0]) != int(hidden.shape[0]):
        raise ValueError(f"rows: hidden {int(hidden.shape[0])} vs labels {int(labels.shape[0])}")
    if weight.requires_grad:
        raise ValueError("frozen_head_ce_rows: the head weight must not require grad (frozen head only)")
    ce, top = _FrozenHeadCE.apply(hidden, weight, labels, chunk_rows, top_k)
    return ce, top
