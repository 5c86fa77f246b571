"""DFlash objective (weighted CE over block slots) against slow loops, and config validation."""

from __future__ import annotations

import math

import pytest
import torch
from drafter_targets import tiny_spec

from drafters.common.blocks import block_input_ids, sample_anchors
from drafters.common.chunked_head import hard_ce_rows, topk_ids
from drafters.common.losses import ObjectiveOutput
from drafters.common.metrics import TOP_K
from drafters.common.target import TargetHead
from drafters.dflash import DFlashConfig, DFlashDraft
from drafters.dflash.objective import dflash_loss, dflash_objective, label_mask, slot_weights

SPEC = tiny_spec(vocab=32, hidden=16, layers=8, heads=4, kv_heads=2)


def test_slot_weights_by_hand() -> None:
    torch.testing.assert_close(slot_weights(4, 2.0), torch.tensor([0.0, 1.0, 0.60653066, 0.36787944]))
    w = slot_weights(16, 7.0)
    assert w[0] == 0 and w[1] == 1 and abs(float(w[15]) - math.exp(-2.0)) < 1e-7


def test_label_mask_golden() -> None:
    loss_mask = torch.tensor([[0, 1, 1, 0, 1, 1, 1]])
    anchors, valid = torch.tensor([[1, 4, 0]]), torch.tensor([[True, True, False]])
    assert label_mask(loss_mask, anchors, valid, 3).int().tolist() == [[[0, 1, 0], [0, 1, 1], [0, 0, 0]]]


def _slow_loss(logits: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor, gamma: float) -> tuple[float, float]:
    num = den = 0.0
    b, nb, bs, _ = logits.shape
    for i in range(b):
        for j in range(nb):
            for k in range(1, bs):
                if not valid[i, j, k]:
                    continue
                z = logits[i, j, k].tolist()
                lse = math.log(sum(math.exp(x) for x in z))
                w = math.exp(-(k - 1) / gamma)
                num += w * (lse - z[int(labels[i, j, k])])
                den += w
    return num, den


def _block_loss(logits: torch.Tensor, labels: torch.Tensor, valid: torch.Tensor, gamma: float) -> ObjectiveOutput:
    """dflash_loss from full block logits [batch, nb, B, V] (the per-row terms the chunked head computes)."""
    b, j, k = valid.nonzero(as_tuple=True)
    rows, y = logits[b, j, k], labels[b, j, k]
    return dflash_loss(hard_ce_rows(rows, y), topk_ids(rows, TOP_K), y, k, gamma, logits.shape[2])


def test_loss_matches_slow_loop() -> None:
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(2, 3, 4, 11, generator=g, requires_grad=True)
    labels = torch.randint(0, 11, (2, 3, 4), generator=g)
    valid = torch.rand(2, 3, 4, generator=g) > 0.4
    valid[:, :, 0] = False
    labels[0, 0, 1] = int(logits[0, 0, 1].argmax())  # at least one hit
    valid[0, 0, 1] = True
    out = _block_loss(logits, labels, valid, 3.0)
    num, den = _slow_loss(logits.detach(), labels, valid, 3.0)
    assert abs(float(out.numerators[0].detach()) - num) < 1e-4 and abs(float(out.denominators[0]) - den) < 1e-5
    assert abs(float(out.loss().detach()) - num / den) < 1e-5
    hits = (logits.detach().argmax(-1) == labels) & valid
    assert [float(x) for x in out.metrics["acc"]] == [float(hits.sum()), float(valid.sum())]
    assert [float(x) for x in out.metrics["valid_tokens"]] == [float(valid.sum()), 1.0]
    for k in range(1, 4):
        assert [float(x) for x in out.metrics[f"acc_pos{k}"]] == [float(hits[:, :, k].sum()),
                                                                  float(valid[:, :, k].sum())]
    out.loss().backward()
    assert logits.grad is not None and not out.denominators.requires_grad


def test_worked_example_of_the_docstring() -> None:
    # slot CEs (., 2.0, 1.0) with gamma 7 -> (2 + e^(-1/7)) / (1 + e^(-1/7)) = 1.5357
    logits = torch.full((1, 1, 3, 2), 0.0)
    logits[0, 0, 1] = torch.tensor([0.0, math.log(math.exp(2.0) - 1)])  # CE(label 0) = 2.0
    logits[0, 0, 2] = torch.tensor([0.0, math.log(math.e - 1)])  # CE(label 0) = 1.0
    out = _block_loss(logits, torch.zeros(1, 1, 3, dtype=torch.long), torch.tensor([[[False, True, True]]]), 7.0)
    assert abs(float(out.loss()) - 1.5357) < 1e-4


def test_objective_matches_explicit_loop() -> None:
    torch.manual_seed(0)
    head = TargetHead(SPEC, torch.randn(32, 16), torch.randn(32, 16), torch.ones(16))
    cfg = DFlashConfig(num_layers=1, block_size=4, target_layer_ids=(1, 5), num_target_features=2,
                       mask_token_id=31, num_anchors=3, loss_gamma=2.0, attn_backend="sdpa")
    model = DFlashDraft(cfg, head)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 31, (2, 10), generator=g)
    loss_mask = torch.tensor([[0, 0, 1, 1, 1, 1, 0, 1, 1, 1], [0, 1, 1, 1, 1, 1, 1, 0, 0, 0]])
    attn = torch.arange(10)[None] < torch.tensor([[10], [6]])
    batch = {"input_ids": ids, "loss_mask": loss_mask, "attention_mask": attn,
             "aux_hidden": torch.randn(2, 10, 32, generator=g)}
    out = dflash_objective(model, batch, torch.Generator().manual_seed(5))
    anchors, valid = sample_anchors(loss_mask.bool() & attn, 4, 3, torch.Generator().manual_seed(5))
    assert valid[1].tolist() == [True, True, False]  # row 1 has candidates 1, 2 only (length 6)
    with torch.no_grad():
        logits = model.logits(model(batch["aux_hidden"], block_input_ids(ids, anchors, 4, 31), anchors, valid))
    num = den = 0.0
    count = 0
    for b in range(2):
        for j in range(3):
            a = int(anchors[b, j])
            if not valid[b, j]:
                continue
            assert loss_mask[b, a] and a + 4 <= int(attn[b].sum())
            for k in range(1, 4):
                if not loss_mask[b, a + k]:
                    continue
                ce = float(torch.nn.functional.cross_entropy(logits[b, j, k][None], ids[b, a + k][None]))
                w = math.exp(-(k - 1) / 2.0)
                num, den, count = num + w * ce, den + w, count + 1
    assert abs(float(out.numerators[0].detach()) - num) < 1e-4 and abs(float(out.denominators[0]) - den) < 1e-5
    assert float(out.metrics["valid_tokens"][0]) == count
    out.loss().backward()
    assert model.fc.weight.grad is not None


def test_config_validation_names_field_and_value() -> None:
    cases = [
        (dict(num_layers=0), r"num_layers: got 0, expected >= 1"),
        (dict(block_size=1), r"block_size: got 1, expected >= 2"),
        (dict(loss_gamma=0.0), r"loss_gamma: got 0.0, expected > 0"),
        (dict(num_anchors=0), r"num_anchors: got 0, expected >= 1"),
        (dict(attn_backend="xla"), r"attn_backend: got 'xla', expected one of"),
        (dict(target_layer_ids=(1, 2)), r"target_layer_ids: got \(1, 2\) \(2 ids\), expected num_target_features=5"),
        (dict(mask_token_id=-3), r"mask_token_id: got -3, expected a token id >= 0"),
    ]
    for kwargs, msg in cases:
        with pytest.raises(ValueError, match=msg):
            DFlashConfig(**kwargs)  # type: ignore[arg-type]
    ok = DFlashConfig(num_target_features=3, mask_token_id=31)
    with pytest.raises(ValueError, match=r"mask_token_id: got 32, expected a token id in 0\.\.31"):
        DFlashConfig(num_target_features=3, mask_token_id=32).resolve(SPEC)
    with pytest.raises(ValueError, match=r"mask_token_id: got None"):
        DFlashConfig(num_target_features=3).resolve(SPEC)
    for bad in ((3, 1, 5), (0, 3, 7)):  # not increasing; 7 = output of the last layer is never captured
        with pytest.raises(ValueError, match=rf"target_layer_ids: got \({bad[0]}, {bad[1]}, {bad[2]}\), expected "
                                             r"strictly increasing output-of-layer ids within 0\.\.6"):
            DFlashConfig(target_layer_ids=bad, num_target_features=3, mask_token_id=31).resolve(SPEC)
    with pytest.raises(ValueError, match=r"target_layer_ids: got \(1, 1\)"):  # L = 4, m = 2 default collides
        DFlashConfig(num_target_features=2, mask_token_id=31).resolve(tiny_spec(layers=4))
    # defaults: output-of-layer 1 + round(i * (L - 4) / (m - 1)); internal ids are those + 1
    assert ok.resolve(SPEC).target_layer_ids == (1, 3, 5) and ok.hidden_state_ids(SPEC) == (2, 4, 6)
    big = tiny_spec(layers=36)
    big = type(big)(**{**big.__dict__, "vocab_size": 151936})
    assert DFlashConfig(mask_token_id=151669).resolve(big).target_layer_ids == (1, 9, 17, 25, 33)
    assert DFlashConfig().block_size == 16 and DFlashConfig().loss_gamma == 7.0 and DFlashConfig().num_anchors == 512
