"""Every family's objective, chunked (drafters/common/chunked_head.py, `loss_chunk_rows`) vs unchunked
(the head + loss terms applied to all rows at once, no checkpoint), on a small float64 batch: the loss
terms, the metrics and every draft parameter's gradient agree."""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch
from test_family_contract import SPEC, _build, _config, _random_samples, _target
from torch import Tensor

import drafters.common.chunked_head as ch
import drafters.common.fused_head as fh
from drafters.registry import get_family

FAMILIES = ("eagle1", "eagle2", "eagle3", "dflash", "dspark", "domino", "peagle")


def _unchunked(fn: Callable[..., tuple[Tensor, ...]], rows: list[Tensor], chunk: int) -> tuple[Tensor, ...]:
    return tuple(fn(*rows))


def _unfused_frozen_head_ce(hidden: Tensor, weight: Tensor, labels: Tensor, chunk: int, top_k: int) -> tuple[Tensor, Tensor]:
    logits = hidden @ weight.T  # [N, V], autograd through the matmul, no chunks
    return ch.hard_ce_rows(logits, labels), ch.topk_ids(logits, top_k)


def _unfused_head_loss(hidden: Tensor, target_hidden: Tensor, weight: Tensor, target_weight: Tensor,
                       markov: Tensor | None, bias: Tensor | None, row_loss: fh.RowLoss,
                       chunk: int) -> tuple[Tensor, tuple[Tensor, ...]]:
    z = hidden @ weight.T  # [N, V], autograd through the matmuls, no chunks
    if markov is not None and bias is not None:
        z = z + markov @ bias
    return row_loss(z, target_hidden @ target_weight.T, 0, int(hidden.shape[0]))


def _unfused_soft_ce_head(head: Callable[[Tensor], Tensor], hidden: Tensor, probs: Tensor, rows: Tensor,
                          chunk: int) -> tuple[Tensor, Tensor]:
    logits = head(hidden)  # [N, Vd], autograd through the head and the soft CE, no chunks
    return ch.soft_ce_prob_rows(logits, probs[rows]), logits.detach().argmax(-1)


def _run(name: str, model: torch.nn.Module, batch: dict[str, Tensor]) -> tuple[Any, dict[str, Tensor]]:
    family = get_family(name)
    model.zero_grad()
    torch.manual_seed(7)  # anchors, COD draws, feature noise: the same draw each run
    out = family.objective(model, batch, progress=0.3)
    out.loss().backward()
    return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


CASES: list[tuple[str, dict[str, Any]]] = [(name, {}) for name in FAMILIES] + [
    ("dspark", {"ce_mode": "restricted", "ce_vocab": 5}), ("dspark", {"ce_mode": "sampled", "ce_vocab": 5}),
    ("dspark", {"markov_head_type": "gated"}), ("dspark", {"markov_rank": 0, "enable_confidence_head": False})]


@pytest.mark.parametrize(("name", "settings"), CASES, ids=[f"{n}-{'-'.join(map(str, s.values()))}" for n, s in CASES])
def test_objective_chunked_equals_unchunked(name: str, settings: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    torch.set_num_threads(1)
    family = get_family(name)
    target = _target(SPEC, seed=0)
    cfg = dataclasses.replace(_config(family, SPEC), **settings)
    samples = _random_samples(family, cfg, target, (11, 7, 5), seed=2)
    model = _build(family, cfg, target, samples, seed=1).double().train()
    batch = {k: v.double() if v.is_floating_point() else v for k, v in family.collate(samples).items()}
    results = {}
    for chunk in (1, 3, 10_000):
        results[chunk] = _run(name, family.with_settings(model, loss_chunk_rows=chunk), batch)
    users = [m for name_, m in list(sys.modules.items())   # ours only: a lazy third-party module raises on getattr
             if name_.startswith("drafters.") and getattr(m, "chunked_rows", None) is ch.chunked_rows]
    fused_users = [m for name_, m in list(sys.modules.items())
                   if name_.startswith("drafters.") and getattr(m, "frozen_head_ce_rows", None) is fh.frozen_head_ce_rows]
    head_users = [m for name_, m in list(sys.modules.items())
                  if name_.startswith("drafters.") and getattr(m, "fused_head_loss", None) is fh.fused_head_loss]
    soft_users = [m for name_, m in list(sys.modules.items())
                  if name_.startswith("drafters.") and getattr(m, "soft_ce_head_rows", None) is fh.soft_ce_head_rows]
    assert any(m.__name__ == f"drafters.{name}.objective" for m in users + fused_users + head_users + soft_users) or (
        name in ("eagle2", "peagle"))
    for module in users:
        monkeypatch.setattr(module, "chunked_rows", _unchunked)
    for module in fused_users:  # the fused frozen-head CE against plain autograd over all rows at once
        monkeypatch.setattr(module, "frozen_head_ce_rows", _unfused_frozen_head_ce)
    for module in head_users:  # the fused head loss (DSpark, EAGLE-1) against plain autograd over all rows at once
        monkeypatch.setattr(module, "fused_head_loss", _unfused_head_loss)
    for module in soft_users:  # the soft-CE head (EAGLE-3 / P-EAGLE) against plain autograd over all rows
        monkeypatch.setattr(module, "soft_ce_head_rows", _unfused_soft_ce_head)
    ref, ref_grads = _run(name, model, batch)
    assert ref_grads and float(ref.denominators.sum()) > 0
    for chunk, (out, grads) in results.items():
        torch.testing.assert_close(out.numerators, ref.numerators, rtol=1e-12, atol=1e-12, msg=f"chunk {chunk}")
        assert torch.equal(out.denominators, ref.denominators)
        got, want = out.metric_values(), ref.metric_values()
        assert got.keys() == want.keys()
        for key in want:
            assert got[key] == pytest.approx(want[key], rel=1e-10, abs=1e-12, nan_ok=True), (chunk, key)
        assert grads.keys() == ref_grads.keys()
        for pname in ref_grads:
            torch.testing.assert_close(grads[pname], ref_grads[pname], rtol=1e-10, atol=1e-12,
                                       msg=f"{name} chunk {chunk}: {pname}")
