"""drafters/common/chunked_head.py: the per-row logit terms against explicit loops, and the chunked
head + loss equal to the unchunked computation (loss, every gradient, argmax / top-k) in float64,
with a ragged last chunk, masked rows, chunk size 1 and chunk sizes >= rows; planted chunk-boundary
faults make the comparison fail; no [rows, vocab] tensor is kept for backward."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from torch import Tensor

import drafters.common.chunked_head as ch
from drafters.common.chunked_head import (
    chunk_bounds,
    chunked_rows,
    draft_vocab_targets,
    hard_ce_rows,
    l1_rows,
    row_argmax,
    soft_ce_prob_rows,
    soft_ce_rows,
    target_probs,
    topk_ids,
)

N, H, R, V = 11, 6, 3, 13


def test_row_terms_vs_loops() -> None:
    g = torch.Generator().manual_seed(0)
    target = torch.randn(4, 5, generator=g, dtype=torch.float64)
    draft = torch.randn(4, 5, generator=g, dtype=torch.float64)
    labels = torch.tensor([0, 3, 4, 1])
    soft, hard, l1 = soft_ce_rows(draft, target), hard_ce_rows(draft, labels), l1_rows(draft, target)
    for i in range(4):
        z, t = [float(x) for x in draft[i]], [float(x) for x in target[i]]
        lse_z, lse_t = math.log(sum(map(math.exp, z))), math.log(sum(map(math.exp, t)))
        p, q = [math.exp(x - lse_t) for x in t], [math.exp(x - lse_z) for x in z]
        assert float(soft[i]) == pytest.approx(-sum(pv * (zv - lse_z) for pv, zv in zip(p, z)), rel=1e-12)
        assert float(hard[i]) == pytest.approx(lse_z - z[int(labels[i])], rel=1e-12)
        assert float(l1[i]) == pytest.approx(sum(abs(a - b) for a, b in zip(q, p)), rel=1e-12)
    assert torch.equal(soft, soft_ce_prob_rows(draft, target_probs(target)))  # the same numerics, probs given
    assert soft.dtype == torch.float64  # float64 stays float64; half precision is widened to float32
    assert soft_ce_rows(draft.bfloat16(), target.bfloat16()).dtype == torch.float32
    tied = torch.tensor([[1.0, 3.0, 3.0, 0.0], [float("nan"), 9.0, 1.0, 2.0], [0.0, 0.0, 0.0, 0.0]]).bfloat16()
    assert torch.equal(row_argmax(tied), tied.argmax(-1)) and row_argmax(tied).tolist() == [1, 0, 0]
    assert torch.equal(row_argmax(draft), draft.argmax(-1))
    assert topk_ids(draft, 2).tolist() == draft.topk(2, -1).indices.tolist() and topk_ids(draft, 99).shape == (4, 5)


def test_chunk_bounds() -> None:
    assert chunk_bounds(5, 2) == [(0, 2), (2, 4), (4, 5)]
    assert chunk_bounds(5, 5) == chunk_bounds(5, 9) == [(0, 5)]
    assert chunk_bounds(0, 3) == [(0, 0)]
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="loss_chunk_rows: got"):
            chunked_rows(lambda x: (x,), [torch.zeros(2)], bad)  # type: ignore[arg-type]


def _problem(seed: int = 0) -> dict[str, Tensor]:
    """A head with every kind of term the families use: trainable head W [V, H], an additive low-rank
    bias W2 e (DSpark's Markov head), a frozen target head Wt rebuilding the target per row, labels,
    row weights with masked (0) rows, a confidence logit per row."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    w = torch.rand(N, generator=g, dtype=torch.float64)
    w[[1, 5, 10]] = 0.0  # masked rows, the last one in the ragged chunk
    return {"hidden": r(N, H).requires_grad_(), "markov": r(N, R).requires_grad_(), "W": r(V, H).requires_grad_(),
            "W2": r(V, R).requires_grad_(), "conf": r(N).requires_grad_(), "Wt": 2.0 * r(V, H),
            "last_hidden": r(N, H), "labels": torch.randint(0, V, (N,), generator=g), "w": w}


def _loss(p: dict[str, Tensor], chunker: Callable[..., tuple[Tensor, ...]],
          chunk: int) -> tuple[Tensor, list[Tensor], tuple[Tensor, ...]]:
    def terms(h: Tensor, e: Tensor, lh: Tensor, y: Tensor) -> tuple[Tensor, ...]:
        z = h @ p["W"].T + e @ p["W2"].T  # [n, V]
        t = lh @ p["Wt"].T  # [n, V] target, rebuilt per chunk
        return soft_ce_rows(z, t), hard_ce_rows(z, y), l1_rows(z, t), topk_ids(z, 3), t.argmax(-1)

    soft, hard, l1, top, t_arg = chunker(terms, [p["hidden"], p["markov"], p["last_hidden"], p["labels"]], chunk)
    conf = torch.nn.functional.binary_cross_entropy(torch.sigmoid(p["conf"]), (1 - 0.5 * l1).detach(),
                                                    reduction="none")  # confidence target from the chunked L1
    loss = (p["w"] * (0.3 * soft + 0.1 * hard + 0.9 * l1 + conf)).sum() / p["w"].sum()
    leaves = [p[k] for k in ("hidden", "markov", "W", "W2", "conf")]
    return loss, list(torch.autograd.grad(loss, leaves)), (top, t_arg)


def _unchunked(fn: Callable[..., tuple[Tensor, ...]], rows: list[Tensor], chunk: int) -> tuple[Tensor, ...]:
    return tuple(fn(*rows))


def _assert_equal_to_unchunked(chunk: int) -> None:
    p = _problem()
    ref_loss, ref_grads, ref_ids = _loss(p, _unchunked, chunk)
    loss, grads, ids = _loss(p, chunked_rows, chunk)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=0.0)
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-11, atol=1e-14)
    for got, want in zip(ids, ref_ids, strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("chunk", [1, 2, 4, N, N + 5])  # 4: chunks 4, 4, 3 (ragged); N, N + 5: one chunk
def test_chunked_equals_unchunked_float64(chunk: int) -> None:
    _assert_equal_to_unchunked(chunk)


@pytest.mark.parametrize("fault", ["drop_last_chunk", "off_by_one_start", "chunks_reordered"])
def test_planted_chunk_faults_are_caught(fault: str, monkeypatch: pytest.MonkeyPatch) -> None:
    def faulty(n: int, c: int) -> list[tuple[int, int]]:
        good = [(s, min(s + c, n)) for s in range(0, max(n, 1), c)]
        if fault == "drop_last_chunk":
            return good[:-1]
        if fault == "off_by_one_start":
            return [(s + (1 if s else 0), e) for s, e in good]
        return good[1:2] + good[:1] + good[2:]

    monkeypatch.setattr(ch, "chunk_bounds", faulty)
    with pytest.raises((AssertionError, RuntimeError, ValueError)):  # wrong values, or rows lost (shapes)
        _assert_equal_to_unchunked(4)


def test_no_rows_by_vocab_tensor_is_saved_for_backward() -> None:
    """Only inputs are kept across the forward: nothing of [> chunk rows, V] waits for backward."""
    p = _problem()
    saved: list[tuple[int, ...]] = []

    def pack(t: Tensor) -> Tensor:
        saved.append(tuple(t.shape))
        return t

    def widest_vocab_tensor(chunker: Callable[..., tuple[Tensor, ...]]) -> int:
        saved.clear()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            _loss(p, chunker, 2)
        return max((s[0] for s in saved if len(s) == 2 and s[1] == V), default=0)

    assert widest_vocab_tensor(_unchunked) == N  # the hook sees the unchunked logits
    assert widest_vocab_tensor(chunked_rows) == 0


def test_empty_rows() -> None:
    p = _problem()
    empty = {**p, "hidden": p["hidden"][:0].detach().requires_grad_(), "markov": p["markov"][:0].detach(),
             "last_hidden": p["last_hidden"][:0], "labels": p["labels"][:0], "w": p["w"][:0], "conf": p["conf"][:0]}
    soft, top = chunked_rows(lambda h, y: (hard_ce_rows(h @ p["W"].T, y), topk_ids(h @ p["W"].T, 5)),
                             [empty["hidden"], empty["labels"]], 4)
    assert soft.shape == (0,) and top.shape == (0, 5) and top.dtype == torch.int64
    soft.sum().backward()


@pytest.mark.parametrize("chunk", [1, 4, N, N + 5])
def test_draft_vocab_targets_equal_the_full_head(chunk: int) -> None:
    """One head matmul per row gives the full-vocab argmax and, for the rows whose argmax is in the draft
    vocab (t2d), softmax of the draft-vocab logits, in row order; chunking changes nothing."""
    p = _problem()
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[[0, 2, 3, 5, 8, 9, 12]] = True
    logits = p["last_hidden"] @ p["Wt"].T  # [N, V]
    calls: list[int] = []

    def head(h: Tensor) -> Tensor:
        calls.append(int(h.shape[0]))
        return h @ p["Wt"].T

    arg, probs = draft_vocab_targets(head, p["last_hidden"], t2d, chunk)
    keep = t2d[logits.argmax(-1)]
    assert 0 < int(keep.sum()) < N  # some rows are dropped, some kept
    assert torch.equal(arg, logits.argmax(-1)) and sum(calls) == N  # each row through the head once
    torch.testing.assert_close(probs, torch.softmax(logits[keep][:, t2d], -1), rtol=1e-14, atol=0.0)
    arg0, probs0 = draft_vocab_targets(head, p["last_hidden"][:0], t2d, chunk)
    assert arg0.shape == (0,) and probs0.shape == (0, int(t2d.sum()))


def test_chunk_count_sync_pads_with_empty_chunks_and_keeps_values() -> None:
    """Under `chunk_count_sync` (the trainer, several ranks: the max count over ranks) a chunked call runs
    sync(local count) chunks, the extra ones on 0 rows; values and gradients are unchanged."""
    from drafters.common.chunked_head import chunk_count_sync

    x = torch.randn(5, 3, dtype=torch.float64, requires_grad=True)
    w = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    sizes: list[int] = []

    def fn(r: torch.Tensor) -> tuple[torch.Tensor]:
        sizes.append(int(r.shape[0]))
        return ((r @ w).logsumexp(-1),)

    (ref,) = chunked_rows(fn, [x], 2)
    ref_grads = torch.autograd.grad(ref.sum(), [x, w])
    assert sizes[:3] == [2, 2, 1]
    asked: list[int] = []
    sizes.clear()
    with chunk_count_sync(lambda n: asked.append(n) or 5):
        (out,) = chunked_rows(fn, [x], 2)
    assert asked == [3] and sizes == [2, 2, 1, 0, 0]
    assert torch.equal(out, ref)
    for g, r in zip(torch.autograd.grad(out.sum(), [x, w]), ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-14, atol=0.0)
    (again,) = chunked_rows(fn, [x], 2)  # outside the context: no sync
    assert asked == [3] and torch.equal(again, ref)
