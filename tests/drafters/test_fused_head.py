"""drafters/common/fused_head.py: the fused frozen head + low-rank bias + weighted row loss equals plain
autograd over all rows (loss, per-row outputs, the gradients of the rows, the bias features and the bias
matrix) in float64, with a ragged last chunk, masked rows and one chunk; planted faults make it fail;
nothing of [rows, V] is kept for backward; bad inputs are refused; the bias matrix comes from a module call."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

import drafters.common.fused_head as fh
from drafters.common.chunked_head import hard_ce_rows, l1_rows, soft_ce_prob_rows, topk_ids

N, H, R, V = 11, 6, 3, 13


def _problem(seed: int = 0) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    w = torch.rand(N, generator=g, dtype=torch.float64)
    w[[1, 5, 10]] = 0.0  # masked rows, the last one in the ragged chunk
    return {"hidden": r(N, H).requires_grad_(), "markov": r(N, R).requires_grad_(), "W2": r(V, R).requires_grad_(),
            "Wt": 2.0 * r(V, H), "target_hidden": r(N, H), "labels": torch.randint(0, V, (N,), generator=g), "w": w}


def _row_loss(p: dict[str, Tensor]) -> fh.RowLoss:
    def row_loss(z: Tensor, t: Tensor, start: int, stop: int) -> tuple[Tensor, tuple[Tensor, ...]]:
        ce, l1 = hard_ce_rows(z, p["labels"][start:stop]), l1_rows(z, t)
        return (p["w"][start:stop] * (0.7 * ce + 0.4 * l1)).sum(), (ce, l1, topk_ids(z, 3))
    return row_loss


def _run(p: dict[str, Tensor], chunk: int | None) -> tuple[Tensor, tuple[Tensor, ...], list[Tensor]]:
    """chunk None: plain autograd over all rows (the reference); else the fused path."""
    linear = torch.nn.Linear(R, V, bias=False).double()
    with torch.no_grad():
        linear.weight.copy_(p["W2"])
    bias = fh.bias_matrix(linear, R, p["markov"])  # [R, V] = W2^T through the module
    if chunk is None:
        z = p["hidden"] @ p["Wt"].T + p["markov"] @ bias
        loss, out = _row_loss(p)(z, p["target_hidden"] @ p["Wt"].T, 0, N)
    else:
        loss, out = fh.fused_head_loss(p["hidden"], p["target_hidden"], p["Wt"], p["Wt"], p["markov"], bias,
                                       _row_loss(p), chunk)
    total = 3.0 * loss  # an incoming gradient other than 1
    return loss, tuple(o.detach() for o in out), list(torch.autograd.grad(total, [p["hidden"], p["markov"],
                                                                                    linear.weight]))


def _assert_equal(chunk: int) -> None:
    p = _problem()
    ref_loss, ref_out, ref_grads = _run(p, None)
    loss, out, grads = _run(p, chunk)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=0.0)
    for got, want in zip(out, ref_out, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-14)
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-11, atol=1e-14)


@pytest.mark.parametrize("chunk", [1, 2, 4, N, N + 5])  # 4: chunks 4, 4, 3 (ragged); N, N + 5: one chunk
def test_fused_head_loss_equals_plain_autograd_float64(chunk: int) -> None:
    _assert_equal(chunk)


@pytest.mark.parametrize("fault", ["drop_last_chunk", "off_by_one_start", "scaled_backward"])
def test_planted_faults_are_caught(fault: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if fault == "scaled_backward":
        good = fh._FusedHeadLoss.backward

        def scaled(ctx: object, grad_total: Tensor, *rest: Tensor | None) -> tuple[Tensor | None, ...]:
            return good(ctx, 1.001 * grad_total, *rest)  # type: ignore[arg-type]

        monkeypatch.setattr(fh._FusedHeadLoss, "backward", staticmethod(scaled))
    else:
        def faulty(n: int, c: int) -> list[tuple[int, int]]:
            bounds = [(s, min(s + c, n)) for s in range(0, max(n, 1), c)]
            return bounds[:-1] if fault == "drop_last_chunk" else [(s + (1 if s else 0), e) for s, e in bounds]

        monkeypatch.setattr(fh, "chunk_bounds", faulty)
    with pytest.raises((AssertionError, RuntimeError, ValueError)):
        _assert_equal(4)


def test_no_rows_by_vocab_tensor_is_saved_and_bad_inputs_are_refused() -> None:
    p = _problem()
    saved: list[tuple[int, ...]] = []

    def pack(t: Tensor) -> Tensor:
        saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss, _ = fh.fused_head_loss(p["hidden"], p["target_hidden"], p["Wt"], p["Wt"], p["markov"], p["W2"].T,
                                     _row_loss(p), 2)
    assert (N, H) in saved and not [s for s in saved if len(s) == 2 and s[0] == N and V in s]  # no [N, V] tensor waits for backward
    with pytest.raises(ValueError, match="must not require grad"):
        fh.fused_head_loss(p["hidden"], p["target_hidden"], p["Wt"].clone().requires_grad_(), p["Wt"], None, None,
                           _row_loss(p), 4)
    with pytest.raises(ValueError, match="both or neither"):
        fh.fused_head_loss(p["hidden"], p["target_hidden"], p["Wt"], p["Wt"], p["markov"], None, _row_loss(p), 4)
    with pytest.raises(ValueError, match="rows: hidden"):
        fh.fused_head_loss(p["hidden"], p["target_hidden"][:3], p["Wt"], p["Wt"], None, None, _row_loss(p), 4)
    empty = {**p, "labels": p["labels"][:0], "w": p["w"][:0]}
    loss, (ce, l1, top) = fh.fused_head_loss(p["hidden"][:0], p["target_hidden"][:0], p["Wt"], p["Wt"], None, None,
                                             _row_loss(empty), 4)
    assert float(loss.detach()) == 0.0 and ce.shape == l1.shape == (0,) and top.shape == (0, 3)
    with torch.no_grad():  # no gradient work without grad: the values only
        nograd, _ = fh.fused_head_loss(p["hidden"], p["target_hidden"], p["Wt"], p["Wt"], p["markov"], p["W2"].T,
                                       _row_loss(p), 4)
    torch.testing.assert_close(nograd, _run(p, None)[0].detach(), rtol=1e-12, atol=0.0)


# -- the soft-CE head (`soft_ce_head_rows`: EAGLE-3 / P-EAGLE, a trainable draft head, targets given)

def _soft_problem(seed: int = 1) -> dict[str, Tensor]:
    g = torch.Generator().manual_seed(seed)
    probs = torch.softmax(torch.randn(5, V, generator=g, dtype=torch.float64), -1)  # P = 5 target positions
    return {"x": torch.randn(N, H, generator=g, dtype=torch.float64).requires_grad_(),
            "W": torch.randn(V, H, generator=g, dtype=torch.float64).requires_grad_(), "probs": probs,
            "rows": torch.randint(0, 5, (N,), generator=g), "w": _problem()["w"]}


def _soft_run(p: dict[str, Tensor], chunk: int | None) -> tuple[Tensor, Tensor, list[Tensor]]:
    head = lambda h: h @ p["W"].T  # noqa: E731
    h = 1.5 * p["x"]  # rows that are not leaves
    if chunk is None:
        logits = head(h)
        ce, arg = soft_ce_prob_rows(logits, p["probs"][p["rows"]]), logits.detach().argmax(-1)
    else:
        ce, arg = fh.soft_ce_head_rows(head, h, p["probs"], p["rows"], chunk)
    loss = (p["w"] * ce).sum() + 0.25 * ce[0]  # per-row weights, masked rows, one row twice
    return loss, arg, list(torch.autograd.grad(loss, [p["x"], p["W"]]))


def _assert_soft_equal(chunk: int) -> None:
    p = _soft_problem()
    ref_loss, ref_arg, ref_grads = _soft_run(p, None)
    loss, arg, grads = _soft_run(p, chunk)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-12, atol=0.0)
    assert torch.equal(arg, ref_arg)
    for got, want in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-11, atol=1e-14)


@pytest.mark.parametrize("chunk", [1, 2, 4, N, N + 5])
def test_soft_ce_head_rows_equals_plain_autograd_float64(chunk: int) -> None:
    _assert_soft_equal(chunk)


@pytest.mark.parametrize("fault", ["scaled_backward", "grad_without_target", "off_by_one_start"])
def test_soft_ce_head_planted_faults_are_caught(fault: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if fault == "scaled_backward":
        good = fh._SoftCE.backward
        monkeypatch.setattr(fh._SoftCE, "backward", staticmethod(lambda ctx, g: good(ctx, 1.001 * g)))
    elif fault == "grad_without_target":
        good_rows = fh.soft_ce_grad_rows
        monkeypatch.setattr(fh, "soft_ce_grad_rows", lambda z, q: (good_rows(z, q)[0], torch.softmax(z.detach(), -1)))
    else:
        monkeypatch.setattr(fh, "synced_chunk_bounds",
                            lambda n, c: [(s + (1 if s else 0), min(s + c, n)) for s in range(0, max(n, 1), c)])
    with pytest.raises((AssertionError, RuntimeError, ValueError)):
        _assert_soft_equal(4)


def test_soft_ce_head_calls_the_head_once_per_chunk_and_keeps_only_the_logit_gradient() -> None:
    p = _soft_problem()
    calls: list[int] = []
    saved: list[tuple[int, ...]] = []

    def head(h: Tensor) -> Tensor:
        calls.append(int(h.shape[0]))
        return h @ p["W"].T

    def pack(t: Tensor) -> Tensor:
        saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        ce, _ = fh.soft_ce_head_rows(head, p["x"], p["probs"], p["rows"], 4)
    ce.sum().backward()
    assert calls == [4, 4, 3]  # no recompute in the backward
    assert sorted(s for s in saved if len(s) == 2 and s[1] == V and s[0] != H) == [(3, V), (4, V), (4, V)]  # d CE / d z
    with pytest.raises(ValueError, match="rows: hidden"):
        fh.soft_ce_head_rows(head, p["x"], p["probs"], p["rows"][:3], 4)
    with torch.no_grad():
        nograd, _ = fh.soft_ce_head_rows(head, p["x"], p["probs"], p["rows"], 4)
    torch.testing.assert_close(nograd, ce.detach(), rtol=1e-14, atol=0.0)


def test_under_bf16_autocast_both_fused_paths_match_plain_autograd() -> None:
    """CPU bf16 autocast, bf16 frozen head, float32 trainable weights: loss and gradients of both fused paths
    agree with plain autograd over the same ops up to bf16 rounding, without a bias in the gradient's scale
    (the incoming scale, 1 / 300 here, is applied in float32, not rounded to bf16)."""
    g = torch.Generator().manual_seed(4)
    n, h, r, v = 37, 64, 8, 500
    x = torch.randn(n, h, generator=g).requires_grad_()
    e = torch.randn(n, r, generator=g).requires_grad_()
    lin = torch.nn.Linear(r, v, bias=False)
    wf = torch.randn(v, h, generator=g).bfloat16()
    th = torch.randn(n, h, generator=g)
    y = torch.randint(0, v, (n,), generator=g)
    probs = torch.softmax(torch.randn(n, v, generator=g), -1)
    dlin = torch.nn.Linear(h, v, bias=False)

    def row_loss(z: Tensor, t: Tensor, start: int, stop: int) -> tuple[Tensor, tuple[Tensor, ...]]:
        return (hard_ce_rows(z, y[start:stop]) + l1_rows(z, t)).sum() / 300.0, ()

    with torch.autocast("cpu", torch.bfloat16):
        fused, _ = fh.fused_head_loss(x, th, wf, wf, e, fh.bias_matrix(lin, r, e), row_loss, 16)
        got = torch.autograd.grad(fused, [x, e, lin.weight])
        ref = row_loss(x @ wf.T + lin(e), th @ wf.T, 0, n)[0]
        want = torch.autograd.grad(ref, [x, e, lin.weight])
        soft, _ = fh.soft_ce_head_rows(dlin, x, probs, torch.arange(n), 16)
        got_soft = torch.autograd.grad(soft.sum() / 300.0, [x, dlin.weight])
        want_soft = torch.autograd.grad(soft_ce_prob_rows(dlin(x), probs).sum() / 300.0, [x, dlin.weight])
    torch.testing.assert_close(fused, ref, rtol=1e-5, atol=1e-6)
    for a, b in [*zip(got, want, strict=True), *zip(got_soft, want_soft, strict=True)]:
        assert float((a - b).norm() / b.norm()) < 1e-2  # bf16 rounding of d logits (before vs after the scale)
        assert abs(float((a * b).sum() / (b * b).sum()) - 1.0) < 1e-3  # no systematic scale error (bf16: 2e-3)
