"""The CPU training fast paths change no number: TTT attention without the dense diagonal keys,
lm_head/loss on loss rows only, and TTT steps that skip rows no later loss needs."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from drafter_targets import TinyTarget, tiny_spec

from drafters.common.attention import ttt_sdpa
from drafters.common.contract import StoreStats
from drafters.common.masks import ttt_attention_mask
from drafters.eagle3 import FAMILY, Eagle3Config
from drafters.eagle3 import objective as eagle3_objective_module
from drafters.eagle3.objective import needed_row_starts


@pytest.mark.parametrize("lengths,heads,kv_heads", [((9, 6), 4, 2), ((16,), 4, 1), ((12, 12), 6, 3)])
@pytest.mark.parametrize("step", [0, 1, 3])
@pytest.mark.parametrize("q_offset", [0, 2])
def test_ttt_sdpa_matches_dense_sdpa(lengths: tuple[int, ...], heads: int, kv_heads: int, step: int,
                                     q_offset: int) -> None:
    g = torch.Generator().manual_seed(step * 10 + q_offset)
    t = max(lengths)
    valid = torch.arange(t)[None] < torch.tensor(lengths)[:, None]
    b = len(lengths)
    q = torch.randn(b, heads, t - q_offset, 8, dtype=torch.float64, generator=g).requires_grad_()
    k = torch.randn(b, kv_heads, (step + 1) * t, 8, dtype=torch.float64, generator=g).requires_grad_()
    v = torch.randn(b, kv_heads, (step + 1) * t, 8, dtype=torch.float64, generator=g).requires_grad_()
    mask = ttt_attention_mask(valid, step, q_offset)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.dense(), enable_gqa=heads != kv_heads)
    out = ttt_sdpa(q, k, v, mask)
    grad_out = torch.randn(ref.shape, dtype=torch.float64, generator=g)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    for a, r in zip(torch.autograd.grad(out, (q, k, v), grad_out), torch.autograd.grad(ref, (q, k, v), grad_out)):
        torch.testing.assert_close(a, r, rtol=1e-10, atol=1e-10)


def test_needed_row_starts_by_hand() -> None:
    assert needed_row_starts(torch.tensor([[0, 0, 0, 1, 1, 0]], dtype=torch.bool), 2) == [0, 1]
    pm = torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1], [0, 0, 0, 0, 1, 1, 0, 0]], dtype=torch.bool)
    # step j needs rows t with a loss at t+1+i, i >= j: first loss position 4 -> rows 4-1-i
    assert needed_row_starts(pm, 3) == [0, 1, 1]
    assert needed_row_starts(torch.zeros(1, 5, dtype=torch.bool), 3) == [0, 4, 4]


def test_row_skipping_changes_no_loss_metric_or_gradient(monkeypatch: pytest.MonkeyPatch) -> None:
    target = TinyTarget(tiny_spec())
    g = torch.Generator().manual_seed(3)
    samples = []
    for n in (14, 11):
        ids = torch.randint(0, target.spec.vocab_size, (n,), generator=g)
        mask = torch.zeros(n, dtype=torch.uint8)
        mask[2 * n // 3:] = 1  # long prompt: later TTT steps skip rows
        samples.append(target.features(ids, (1, 2, 3), mask))
    batch = FAMILY.collate(samples)
    cfg = Eagle3Config(draft_vocab_size=24, aux_layer_ids=(1, 2, 3), ttt_steps=3, attn_backend="sdpa")
    torch.manual_seed(1)
    model = FAMILY.build(cfg, target.head(), StoreStats(torch.arange(target.spec.vocab_size).flip(0)))

    def run() -> tuple[object, dict[str, torch.Tensor]]:
        model.zero_grad()
        out = FAMILY.objective(model, batch)
        out.loss().backward()
        return out, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    targets = eagle3_objective_module.prepare_targets(model, batch)
    assert needed_row_starts(targets.position_mask, 3)[1] > 0  # skipping is exercised
    fast, fast_grads = run()
    monkeypatch.setattr(eagle3_objective_module, "needed_row_starts", lambda pm, s: [0] * s)
    full, full_grads = run()
    torch.testing.assert_close(fast.numerators, full.numerators)  # type: ignore[attr-defined]
    assert torch.equal(fast.denominators, full.denominators)  # type: ignore[attr-defined]
    assert fast.metric_values() == full.metric_values()  # type: ignore[attr-defined]
    assert fast_grads.keys() == full_grads.keys()
    for name in fast_grads:
        torch.testing.assert_close(fast_grads[name], full_grads[name], rtol=1e-5, atol=1e-6)
