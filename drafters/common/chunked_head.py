"""The LM head and every loss term that reads its logits, over chunks of rows (issue 21).

`chunked_rows` runs head + per-row loss terms on `chunk_rows` rows at a time, each chunk checkpointed, so
one chunk of [rows, vocab] logits is alive at once; `chunk_count_sync` keeps the chunk count equal on
every rank (a sharded FSDP2 head is a collective per call). Per-row terms compute in float32."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from drafters.common.vocab import target_logits_to_draft

# Rows per chunk (every family's `loss_chunk_rows` default). scripts/bench_chunked_loss.py, rows 4096,
# vocab 32000, hidden 1024, EAGLE-3's soft CE against the rebuilt target with a trainable head, forward +
# backward, CPU float32: peak memory vs unchunked 0.16 at 256 and 512 rows (the floor: the head's weight
# gradient and the row tensors), 0.26 at 1024, 0.50 at 2048; time (two runs on a busy machine) 1.09x /
# 1.21x at 512 (the recompute of the two head matmuls), 1.12x / 1.25x at 1024, 1.26x at 256.
DEFAULT_LOSS_CHUNK_ROWS = 512

RowFn = Callable[..., tuple[Tensor, ...]]
_COUNT_SYNC: ContextVar[Callable[[int], int] | None] = ContextVar("chunk_count_sync", default=None)


@contextmanager
def chunk_count_sync(sync: Callable[[int], int]) -> Iterator[None]:
    """Within: each chunked call runs max(local count, sync(local count)) chunks, the extra ones empty;
    `sync` runs once per call in the same order on every rank (the trainer: all-reduce max)."""
    token = _COUNT_SYNC.set(sync)
    try:
        yield
    finally:
        _COUNT_SYNC.reset(token)


def synced_chunk_bounds(n: int, chunk_rows: int) -> list[tuple[int, int]]:
    """`chunk_bounds`, padded with empty chunks to sync(count) under `chunk_count_sync` (module calls)."""
    bounds = chunk_bounds(n, chunk_rows)
    sync = _COUNT_SYNC.get()
    if sync is not None:
        bounds += [(n, n)] * (sync(len(bounds)) - len(bounds))
    return bounds


def check_chunk_rows(chunk_rows: int) -> None:
    """A config's `loss_chunk_rows`: an int >= 1."""
    if isinstance(chunk_rows, bool) or not isinstance(chunk_rows, int) or chunk_rows < 1:
        raise ValueError(f"loss_chunk_rows: got {chunk_rows!r}, expected an int >= 1")


def chunk_bounds(n: int, chunk_rows: int) -> list[tuple[int, int]]:
    """[start, stop) of each chunk of n rows: (0, c), (c, 2c), ..., the last one ragged; [(0, 0)]
    for n = 0 (one empty chunk). Worked example: n 5, c 2 -> [(0, 2), (2, 4), (4, 5)]."""
    return [(start, min(start + chunk_rows, n)) for start in range(0, max(n, 1), chunk_rows)]


def chunked_rows(fn: RowFn, rows: Sequence[Tensor], chunk_rows: int) -> tuple[Tensor, ...]:
    """`fn(*[r[i:j] for r in rows])` over row chunks [i, j) of rows sharing dim 0, per-row outputs [n, ...]
    concatenated to [N, ...]; with N = 0, fn runs once on the empty rows."""
    check_chunk_rows(chunk_rows)
    n = int(rows[0].shape[0])
    if any(int(r.shape[0]) != n for r in rows):
        raise ValueError(f"rows: dim 0 sizes {[int(r.shape[0]) for r in rows]}, expected all equal")
    needs_grad = torch.is_grad_enabled()
    pieces: list[tuple[Tensor, ...]] = []
    for start, stop in synced_chunk_bounds(n, chunk_rows):
        chunk = [r[start:stop] for r in rows]
        if needs_grad:
            out = checkpoint(fn, *chunk, use_reentrant=False, preserve_rng_state=False)
        else:
            out = fn(*chunk)
        pieces.append(tuple(out))
    if len(pieces) == 1:
        return pieces[0]
    return tuple(torch.cat(parts, dim=0) for parts in zip(*pieces, strict=True))


def head_weight(weight: Tensor, like: Tensor) -> Tensor:
    """A frozen head weight [V, H] (no grad) cast once per loss to the dtype its matmul with `like` runs in
    (autocast's, or like's): the same logits without a float32 copy of a bf16 head."""
    dtype = like.dtype
    device = like.device.type
    if torch.is_autocast_enabled(device) and like.dtype in (torch.float32, torch.get_autocast_dtype(device)):
        dtype = torch.get_autocast_dtype(device)
    return weight.detach().to(dtype)


def wide_float(x: Tensor) -> Tensor:
    """float32 for half / bfloat16 / float32, float64 stays float64."""
    return x.to(torch.promote_types(x.dtype, torch.float32))


def target_probs(target_logits: Tensor) -> Tensor:
    """[n, V] target logits -> softmax [n, V] in float32 (float64 stays float64), no grad."""
    return torch.softmax(wide_float(target_logits.detach()), dim=-1)


def soft_ce_prob_rows(draft_logits: Tensor, probs: Tensor) -> Tensor:
    """[n, V] draft logits, [n, V] target probabilities (`target_probs`, no grad) -> [n]:
    -sum_v probs_v * log_softmax(draft)_v."""
    if draft_logits.shape != probs.shape:
        raise ValueError(f"draft_logits {tuple(draft_logits.shape)} vs target {tuple(probs.shape)}")
    return -(probs.detach() * torch.log_softmax(wide_float(draft_logits), dim=-1)).sum(-1)


def soft_ce_rows(draft_logits: Tensor, target_logits: Tensor) -> Tensor:
    """[n, V], [n, V] (target: no grad) -> [n]: -sum_v softmax(target)_v * log_softmax(draft)_v."""
    return soft_ce_prob_rows(draft_logits, target_probs(target_logits))


def hard_ce_rows(logits: Tensor, labels: Tensor) -> Tensor:
    """[n, V], int64 [n] -> [n]: -log_softmax(logits)[label]."""
    return F.cross_entropy(wide_float(logits), labels, reduction="none")


def l1_rows(draft_logits: Tensor, target_logits: Tensor) -> Tensor:
    """[n, V], [n, V] (target: no grad) -> [n]: sum_v |softmax(draft) - softmax(target)| (= 2 TV)."""
    return (torch.softmax(wide_float(draft_logits), dim=-1) - target_probs(target_logits)).abs().sum(-1)


def row_argmax(logits: Tensor) -> Tensor:
    """[n, V] -> int64 [n]: argmax(-1) as `max(-1).indices` (first of tied maxima; no grad), which is
    faster than `argmax` on CPU for bfloat16."""
    return logits.detach().max(-1).indices


def topk_ids(logits: Tensor, k: int) -> Tensor:
    """[n, V] -> int64 [n, min(k, V)]: the top ids, best first (no grad; metrics)."""
    return logits.detach().topk(min(k, logits.shape[-1]), dim=-1).indices


def draft_vocab_targets(head: Callable[[Tensor], Tensor], hidden: Tensor, t2d: Tensor,
                        chunk_rows: int) -> tuple[Tensor, Tensor]:
    """What EAGLE-3 / P-EAGLE need of the frozen target head, chunk by chunk (no grad): hidden [N, H], t2d
    bool [V] -> (argmax int64 [N], the draft-vocab `target_probs` [count, Vd] of rows whose argmax is in it)."""
    check_chunk_rows(chunk_rows)
    args, probs = [], []
    with torch.no_grad():
        for start, stop in chunk_bounds(int(hidden.shape[0]), chunk_rows):  # no module call: no count sync
            logits = head(hidden[start:stop])  # [n, V]
            arg = row_argmax(logits)
            args.append(arg)
            probs.append(target_probs(target_logits_to_draft(logits[t2d[arg]], t2d)))  # [kept, Vd]
            del logits
    return torch.cat(args), torch.cat(probs)


def hard_ce_grad_rows(logits: Tensor, labels: Tensor) -> tuple[Tensor, Tensor]:
    """[n, V], int64 [n] in 0..V-1 -> (CE [n] as `hard_ce_rows`, d CE_i / d logits_i [n, V] =
    softmax(logits_i) - onehot(label_i)), in float32 (float64 stays float64); no grad."""
    z = wide_float(logits.detach())
    lse = torch.logsumexp(z, dim=-1)  # [n]
    ce = lse - z.gather(-1, labels[:, None]).squeeze(-1)
    grad = (z - lse[:, None]).exp_()  # softmax
    grad.scatter_add_(-1, labels[:, None], torch.full_like(ce[:, None], -1.0))
    return ce, grad


def soft_ce_grad_rows(draft_logits: Tensor, probs: Tensor) -> tuple[Tensor, Tensor]:
    """[n, V] draft logits, [n, V] target probabilities -> (soft CE [n] as `soft_ce_prob_rows`, d CE_i / d
    logits_i [n, V] = softmax(logits_i) * sum(probs_i) - probs_i), float32 (float64 stays float64); no grad."""
    if draft_logits.shape != probs.shape:
        raise ValueError(f"draft_logits {tuple(draft_logits.shape)} vs target {tuple(probs.shape)}")
    p = probs.detach()
    log_q = torch.log_softmax(wide_float(draft_logits.detach()), dim=-1)  # [n, V]
    ce = -(p * log_q).sum(-1)
    return ce, log_q.exp_().mul_(p.sum(-1, keepdim=True)).sub_(p)
