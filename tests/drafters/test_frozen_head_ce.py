"""drafters/common/fused_head.py `frozen_head_ce_rows` (DFlash's frozen lm_head + CE, the row gradient kept
from the forward): equal to plain autograd over all rows in float64 (chunk sizes 1, 2, 4 ragged, N, N + 5;
masked rows), planted faults caught, no [rows, vocab] tensor kept, trainable heads refused, and under bf16
autocast equal to the unfused chunks up to bf16 rounding."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

import drafters.common.fused_head as fh
from drafters.common.chunked_head import chunked_rows, hard_ce_rows, head_weight, topk_ids

N, H, V = 11, 6, 13


def _fused_problem(seed: int = 0) -> dict[str, Tensor]:
    """Rows h = x @ A (A trainable, so the row gradient reaches a parameter), a frozen head Wf [V, H],
    labels, row weights with masked (0) rows, the last one in the ragged chunk."""
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    w = torch.rand(N, generator=g, dtype=torch.float64)
    w[[1, 5, 10]] = 0.0
    return {"x": r(N, H).requires_grad_(), "A": r(H, H).requires_grad_(), "Wf": 2.0 * r(V, H),
            "labels": torch.randint(0, V, (N,), generator=g), "w": w}


def _fused_loss(p: dict[str, Tensor], chunk: int | None) -> tuple[Tensor, list[Tensor], Tensor]:
    """chunk None: plain autograd over all rows (the reference); else the fused chunked path."""
    h = p["x"] @ p["A"]
    if chunk is None:
        logits = h @ p["Wf"].T
        ce, top = hard_ce_rows(logits, p["labels"]), topk_ids(logits, 3)
    else:
        ce, top = fh.frozen_head_ce_rows(h, p["Wf"], p["labels"], chunk, 3)
    loss = (p["w"] * ce).sum() / p["w"].sum() + 0.25 * ce[0]  # a weighted sum plus one row again
    return loss, list(torch.autograd.grad(loss, [p["x"], p["A"]])), top


def _assert_fused_equal(chunk: int) -> None:
    p = _fused_problem()
    ref_loss, ref_grads, ref_top = _fused_loss(p, None)
    loss, grads, top = _fused_loss(p, chunk)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=0.0)
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-11, atol=1e-14)
    assert torch.equal(top, ref_top)


@pytest.mark.parametrize("chunk", [1, 2, 4, N, N + 5])  # 4: chunks 4, 4, 3 (ragged); N, N + 5: one chunk
def test_fused_frozen_head_ce_equals_unchunked_float64(chunk: int) -> None:
    _assert_fused_equal(chunk)


@pytest.mark.parametrize("fault", ["drop_last_chunk", "off_by_one_start", "chunks_reordered", "grad_without_onehot",
                                   "grad_of_first_row_everywhere"])
def test_fused_planted_faults_are_caught(fault: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if fault == "grad_without_onehot":
        monkeypatch.setattr(fh, "hard_ce_grad_rows", lambda z, y: (hard_ce_rows(z, y), torch.softmax(z.detach(), -1)))
    elif fault == "grad_of_first_row_everywhere":
        good = fh.hard_ce_grad_rows
        monkeypatch.setattr(fh, "hard_ce_grad_rows", lambda z, y: (lambda c, d: (c, d[:1].expand_as(d)))(*good(z, y)))
    else:
        def faulty(n: int, c: int) -> list[tuple[int, int]]:
            good_b = [(s, min(s + c, n)) for s in range(0, max(n, 1), c)]
            if fault == "drop_last_chunk":
                return good_b[:-1]
            if fault == "off_by_one_start":
                return [(s + (1 if s else 0), e) for s, e in good_b]
            return good_b[1:2] + good_b[:1] + good_b[2:]

        monkeypatch.setattr(fh, "chunk_bounds", faulty)
    with pytest.raises((AssertionError, RuntimeError, ValueError)):
        _assert_fused_equal(4)


def test_fused_keeps_no_rows_by_vocab_tensor_and_rejects_trainable_heads() -> None:
    p = _fused_problem()
    saved: list[tuple[int, ...]] = []

    def pack(t: Tensor) -> Tensor:
        saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        _fused_loss(p, 2)
    assert not [s for s in saved if V in s] and (N, H) in saved  # only the [N, H] row gradient
    with pytest.raises(ValueError, match="must not require grad"):
        fh.frozen_head_ce_rows(p["x"], p["Wf"].clone().requires_grad_(), p["labels"], 4, 3)
    with pytest.raises(ValueError, match="rows: hidden"):
        fh.frozen_head_ce_rows(p["x"], p["Wf"], p["labels"][:3], 4, 3)
    ce, top = fh.frozen_head_ce_rows(p["x"][:0], p["Wf"], p["labels"][:0], 4, 5)
    assert ce.shape == (0,) and top.shape == (0, 5) and top.dtype == torch.int64
    ce.sum().backward()


def test_fused_under_bf16_autocast_matches_the_unfused_chunks() -> None:
    """CPU bf16 autocast, a bf16 frozen head kept as is (`head_weight`), float32 rows: loss and row
    gradient of the fused path agree with `chunked_rows` over the same terms (bf16 rounding apart)."""
    g = torch.Generator().manual_seed(3)
    h = torch.randn(37, 64, generator=g).requires_grad_()
    wf = torch.randn(500, 64, generator=g).bfloat16()
    y = torch.randint(0, 500, (37,), generator=g)
    wt = torch.rand(37, generator=g)
    with torch.autocast("cpu", torch.bfloat16):
        head = head_weight(wf, h)
        assert head is wf or head.data_ptr() == wf.data_ptr()  # no copy: already autocast's dtype
        ce, top = fh.frozen_head_ce_rows(h, head, y, 16, 5)
        (gf,) = torch.autograd.grad((wt * ce).sum(), [h])
        ref, ref_top = chunked_rows(lambda a, b: (hard_ce_rows(a @ wf.float().T, b), topk_ids(a @ wf.float().T, 5)),
                                    [h, y], 16)
        (gr,) = torch.autograd.grad((wt * ref).sum(), [h])
    torch.testing.assert_close(ce, ref, rtol=1e-6, atol=1e-6)
    assert torch.equal(top, ref_top)
    assert float((gf - gr).norm() / gr.norm()) < 1e-2  # bf16 rounding of d logits (before vs after the scale)
    assert head_weight(wf, h.double()).dtype == torch.float64  # no autocast: the rows' dtype
