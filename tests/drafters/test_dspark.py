"""DSpark (drafters/dspark): golden anchor layouts, the loss against a slow per-row loop (full,
restricted and sampled CE, L1, confidence BCE, slot weights), non-finite rows dropped and counted,
head parameter names/shapes, config validation, and the Markov proposer's left-to-right drafting
against a hand-rolled loop plus lossless greedy reference decoding."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from drafter_targets import damaged_copy, tiny_spec

from drafters.common.blocks import (
    block_input_ids,
    block_labels,
    next_token_anchor_candidates,
    next_token_prefix_mask,
    next_token_slot_weights,
    sample_anchors,
)
from drafters.common.contract import DraftContext
from drafters.common.sampling import SamplingParams
from drafters.common.target import TargetHead
from drafters.dspark.config import DSparkConfig
from drafters.dspark.model import DSparkDraft
from drafters.dspark.objective import dspark_objective
from drafters.dspark.proposer import DSparkProposer

SPEC = tiny_spec(vocab=32, hidden=16, layers=8, heads=4, kv_heads=2)
BS = 3


def _head(seed: int = 0) -> TargetHead:
    g = torch.Generator().manual_seed(seed)
    return TargetHead(SPEC, torch.randn(32, 16, generator=g), torch.randn(32, 16, generator=g), torch.ones(16))


def _model(seed: int = 0, **kw: object) -> DSparkDraft:
    torch.manual_seed(seed)
    cfg = DSparkConfig(num_layers=2, block_size=BS, target_layer_ids=(1, 5), num_target_features=2, mask_token_id=31,
                       attn_backend="sdpa", **{"markov_rank": 6, **kw})  # type: ignore[arg-type]
    model = DSparkDraft(cfg, _head())
    with torch.no_grad():  # heads away from their small init: the Markov bias and confidence matter
        if model.markov_head is None:
            return model
        model.markov_head.markov_w1.weight.normal_(0.0, 1.0)
        model.markov_head.markov_w2.weight.normal_(0.0, 0.5)
    return model


def test_layout_golden() -> None:
    valid = torch.tensor([[0, 1, 1, 1, 0, 1]], dtype=torch.bool)
    assert next_token_anchor_candidates(valid).int().tolist() == [[0, 1, 1, 0, 0, 0]]
    anchors, ok = torch.tensor([[1, 2]]), torch.tensor([[True, True]])
    # anchor 1: labels at 2, 3, 4 -> valid 1, 1, 0 -> prefix [1, 1, 0]; anchor 2: labels 3, 4, 5 -> [1, 0, 0] (5 is
    # valid, but the run ended at 4)
    assert next_token_prefix_mask(valid, anchors, ok, 3).int().tolist() == [[[1, 1, 0], [1, 0, 0]]]
    ids = torch.tensor([[10, 11, 12, 13, 14, 15]])
    assert block_labels(ids, anchors + 1, 3).tolist() == [[[12, 13, 14], [13, 14, 15]]]  # slot k: x_{a+k+1}
    assert block_labels(ids, anchors, 3).tolist() == [[[11, 12, 13], [12, 13, 14]]]  # predecessors x_{a+k}
    assert block_input_ids(ids, anchors, 3, 31).tolist() == [[[11, 31, 31], [12, 31, 31]]]
    torch.testing.assert_close(next_token_slot_weights(3, 2.0), torch.tensor([1.0, 0.60653066, 0.36787944]))


def _batch(seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    b, t = 2, 11
    mask = torch.ones(b, t, dtype=torch.uint8)
    mask[:, :3] = 0
    mask[1, 7] = 0  # a hole: runs through position 7 are cut
    attn = torch.ones(b, t, dtype=torch.bool)
    attn[1, 9:] = False
    mask[1, 9:] = 0
    last = torch.randn(b, t, 16, generator=g)
    return {"input_ids": torch.randint(0, 31, (b, t), generator=g), "loss_mask": mask, "attention_mask": attn,
            "aux_hidden": torch.randn(b, t, 32, generator=g), "last_hidden": last / last.norm(dim=-1, keepdim=True) * 4}


def _slow(model: DSparkDraft, batch: dict[str, torch.Tensor], seed: int) -> tuple[float, float, dict[str, float]]:
    """Per sequence, anchor and slot, with Python arithmetic on the model's own row outputs."""
    cfg = model.cfg
    ids, valid = batch["input_ids"], batch["loss_mask"].bool() & batch["attention_mask"]
    g = torch.Generator().manual_seed(seed)
    cand = torch.zeros_like(valid)
    seq = valid.shape[1]
    for i in range(valid.shape[0]):
        for a in range(seq - 1):
            cand[i, a] = bool(valid[i, a]) and bool(valid[i, a + 1])
    anchors, ok = sample_anchors(cand, 1, cfg.num_anchors, g)
    negatives = torch.randperm(SPEC.vocab_size, generator=g)[: cfg.ce_vocab] if cfg.ce_mode == "sampled" else None
    hidden = model.block_hidden(batch["aux_hidden"], block_input_ids(ids, anchors, BS, 31), anchors, ok)
    num = den = 0.0
    terms = {"ce": 0.0, "l1": 0.0, "conf_bce": 0.0}
    for i in range(ids.shape[0]):
        for j in range(anchors.shape[1]):
            if not ok[i, j]:
                continue
            a = int(anchors[i, j])
            for k in range(BS):
                if not all(a + q + 1 < seq and bool(valid[i, a + q + 1]) for q in range(k + 1)):
                    break
                label, prev = int(ids[i, a + k + 1]), int(ids[i, a + k])
                logits, conf = model.head_logits(hidden[i, j, k][None], torch.tensor([prev]))
                z = logits[0].tolist()
                zt = (model.target_lm_head @ batch["last_hidden"][i, a + k]).tolist()
                pd = [math.exp(x) / sum(math.exp(y) for y in z) for x in z]
                pt = [math.exp(x) / sum(math.exp(y) for y in zt) for x in zt]
                if cfg.ce_mode == "full":
                    cands = list(range(len(z)))
                    ce = math.log(sum(math.exp(z[v]) for v in cands)) - z[label]
                elif cfg.ce_mode == "restricted":
                    top = sorted(range(len(pt)), key=lambda v: -pt[v])[: cfg.ce_vocab]
                    cands = sorted(set(top) | {label})
                    ce = math.log(sum(math.exp(z[v]) for v in cands)) - z[label]
                else:
                    assert negatives is not None
                    corr = math.log((len(z) - 1) / cfg.ce_vocab)
                    ce = math.log(math.exp(z[label]) + sum(math.exp(z[int(v)] + corr) for v in negatives
                                                           if int(v) != label)) - z[label]
                l1 = sum(abs(p - q) for p, q in zip(pd, pt))
                c = float(conf[0]) if conf is not None else None
                star = min(max(1 - 0.5 * l1, 0.0), 1.0)
                bce = 0.0 if c is None else -(star * math.log(c) + (1 - star) * math.log(1 - c))
                w = math.exp(-k / cfg.loss_gamma)
                num += w * (cfg.ce_weight * ce + cfg.l1_weight * l1 + cfg.conf_weight * bce)
                den += w
                terms["ce"] += w * ce
                terms["l1"] += w * l1
                terms["conf_bce"] += w * bce
    return num, den, {k: v / den for k, v in terms.items()}


@pytest.mark.parametrize("settings", [
    {}, {"ce_mode": "restricted", "ce_vocab": 5}, {"ce_mode": "sampled", "ce_vocab": 7},
    {"markov_head_type": "gated"}, {"enable_confidence_head": False, "confidence_head_with_markov": False},
    {"confidence_head_with_markov": False},
], ids=["full", "restricted", "sampled", "gated", "no_conf", "conf_without_markov"])
def test_loss_matches_a_slow_loop(settings: dict[str, object]) -> None:
    model = _model(**settings).eval()
    batch = _batch()
    with torch.no_grad():
        out = dspark_objective(model, batch, torch.Generator().manual_seed(5))
        num, den, terms = _slow(model, batch, 5)
    assert den > 0
    assert math.isclose(float(out.denominators[0]), den, rel_tol=1e-5)
    assert math.isclose(float(out.numerators[0]), num, rel_tol=1e-4), (float(out.numerators[0]), num)
    values = out.metric_values()
    for key, value in terms.items():
        assert math.isclose(values[key], value, rel_tol=1e-4, abs_tol=1e-6), key
    assert values["nonfinite_rows"] == 0
    assert 0 <= values["acc"] <= values["top5"] <= 1 and values["valid_tokens"] > 10


def test_gradients_reach_every_parameter_and_nonfinite_rows_are_dropped() -> None:
    model = _model().train()
    batch = _batch()
    out = dspark_objective(model, batch, torch.Generator().manual_seed(5))
    out.loss().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and bool(torch.isfinite(p.grad).all()) and float(p.grad.abs().sum()) > 0, name
    bad = dict(batch)
    bad["last_hidden"] = batch["last_hidden"].clone()
    bad["last_hidden"][0, 5] = float("nan")  # p_t of every row reading position 5 is NaN
    model.zero_grad()
    with torch.no_grad():
        clean = dspark_objective(model, batch, torch.Generator().manual_seed(5))
    planted = dspark_objective(model, bad, torch.Generator().manual_seed(5))
    dropped = int(planted.metric_values()["nonfinite_rows"])
    assert dropped >= 1 and bool(torch.isfinite(planted.loss()))
    assert float(planted.metrics["valid_tokens"][0]) == float(clean.metrics["valid_tokens"][0])
    assert float(planted.denominators[0]) < float(clean.denominators[0])
    planted.loss().backward()
    assert all(bool(torch.isfinite(p.grad).all()) for p in model.parameters() if p.grad is not None)


def test_head_names_and_shapes() -> None:
    shapes = {k: tuple(v.shape) for k, v in _model(markov_head_type="gated").state_dict().items()}
    assert shapes["markov_head.markov_w1.weight"] == (32, 6) and shapes["markov_head.markov_w2.weight"] == (32, 6)
    assert shapes["markov_head.gate_proj.weight"] == (6, 22) and shapes["markov_head.gate_proj.bias"] == (6,)
    assert shapes["confidence_head.proj.weight"] == (1, 22) and shapes["confidence_head.proj.bias"] == (1,)
    plain = {k for k in _model().state_dict() if k.startswith(("markov_head", "confidence_head"))}
    assert plain == {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight", "confidence_head.proj.weight",
                     "confidence_head.proj.bias"}


@pytest.mark.parametrize(("settings", "message"), [
    ({"markov_head_type": "rnn"}, r"markov_head_type: got 'rnn', expected one of \('vanilla', 'gated'\)"),
    ({"markov_rank": 0, "markov_head_type": "gated"}, "markov_head_type: got 'gated' with markov_rank 0"),
    ({"markov_rank": 0}, "confidence_head_with_markov: got True with markov_rank 0"),
    ({"ce_mode": "top"}, r"ce_mode: got 'top', expected one of"),
    ({"ce_mode": "sampled"}, "ce_vocab: got 0 with ce_mode 'sampled', expected >= 1"),
    ({"l1_weight": -1.0}, "l1_weight: got -1.0, expected >= 0"),
])
def test_config_errors_name_the_field(settings: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DSparkConfig(**settings)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="ce_vocab: got 32, expected < vocab_size=32"):
        _model(ce_mode="restricted", ce_vocab=32)


def _ctx(seed: int, n: int) -> DraftContext:
    g = torch.Generator().manual_seed(seed)
    return DraftContext(torch.randint(0, 31, (n + 1,), generator=g),
                        tuple(torch.randn(n, 16, generator=g) for _ in range(SPEC.num_hidden_layers + 1)))


def test_proposer_drafts_left_to_right_through_the_markov_head() -> None:
    model = _model().eval()
    proposer = DSparkProposer(model)
    ctx = _ctx(3, 6)
    got = proposer.propose(ctx, BS, SamplingParams())
    features = torch.cat([ctx.target_hidden_states[i] for i in (2, 6)], dim=-1)  # ids (1, 5) + 1
    block = torch.tensor([[[int(ctx.token_ids[-1]), 31, 31]]])
    with torch.no_grad():
        h = model.block_hidden(features[None], block, torch.tensor([[6]]), torch.tensor([[True]]))[0, 0]
        prev, want = int(ctx.token_ids[-1]), []
        for k in range(BS):
            z = model.logits(h[k]) + model.markov_head.markov_w2.weight @ model.markov_head.markov_w1.weight[prev]  # type: ignore[union-attr]
            prev = int(z.argmax())
            want.append(prev)
    assert got.token_ids.tolist() == want and got.probs is None
    base = [int(model.logits(h[k]).argmax()) for k in range(BS)]
    assert base != want  # the Markov bias changes the drafts here (so the test sees a missing bias)
    sampled = proposer.propose(ctx, 2, SamplingParams(temperature=1.0), torch.Generator().manual_seed(0))
    assert sampled.probs is not None and sampled.probs.shape == (2, 32)
    torch.testing.assert_close(sampled.probs.sum(-1), torch.ones(2))
    with pytest.raises(ValueError, match="1 <= num_tokens <= block_size = 3"):
        proposer.propose(ctx, 4, SamplingParams())


def test_export_writes_every_engine_key_and_check_export_refuses_damage(tmp_path: Path) -> None:
    from drafters.dflash.export import check_export
    from drafters.dspark import FAMILY
    from drafters.dspark.export import DSparkExportConfig

    model = _model(markov_head_type="gated").eval()
    out = FAMILY.export(model, model.cfg, SPEC, tmp_path / "ok")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Qwen3DSparkModel"] and "eagle_config" not in config
    assert (config["block_size"], config["dspark_block_size"], config["markov_rank"], config["dspark_markov_rank"]) == \
        (3, 3, 6, 6)
    assert (config["markov_head_type"], config["dspark_markov_head_type"]) == ("gated", "gated")
    assert (config["enable_confidence_head"], config["confidence_head_with_markov"], config["sample_from_anchor"]) == \
        (True, True, True)
    assert config["dspark_target_layer_ids"] == config["dflash_config"]["target_layer_ids"] == [1, 5]
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 6]  # vLLM capture index = output-of-layer + 1
    assert config["mask_token_id"] == config["dspark_noise_token_id"] == config["dflash_config"]["mask_token_id"] == 31
    loaded = FAMILY.load_export(out, _head())
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key

    def damaged(name: str, edit_config: Any = None, edit_tensors: Any = None) -> Path:
        return damaged_copy(out, tmp_path / name, edit_config, edit_tensors)

    cases = [
        (damaged("no_rank", edit_config=lambda c: c.pop("markov_rank")), r"missing keys \['markov_rank'\]"),
        (damaged("eagle_cfg", edit_config=lambda c: c.update(eagle_config={})), "key 'eagle_config'"),
        (damaged("conf_default", edit_config=lambda c: c.update(confidence_head_with_markov=False)),
         "unexpected tensors|has shape"),
        (damaged("ids", edit_config=lambda c: c.update(dspark_target_layer_ids=[2, 5])),
         r"key 'dspark_target_layer_ids' = \[2, 5\], expected \[1, 5\]"),
        (damaged("no_w2", edit_tensors=lambda t: t.pop("markov_head.markov_w2.weight")),
         r"missing tensors \['markov_head.markov_w2.weight'\]"),
    ]
    for bad, message in cases:
        with pytest.raises(ValueError, match=message):
            check_export(bad, DSparkExportConfig)


def _unfused_reference(model: DSparkDraft, batch: dict[str, torch.Tensor], seed: int) -> tuple[torch.Tensor, float]:
    """The loss as the module docstring writes it, plain autograd over all rows at once: draft and target
    logits [N, V], row = ce_weight * ce + l1_weight * l1 + conf_weight * conf, non-finite rows dropped."""
    from drafters.common.chunked_head import l1_rows
    from drafters.dspark.objective import ce_rows, sampled_negatives

    cfg, g = model.cfg, torch.Generator().manual_seed(seed)
    ids = batch["input_ids"]
    valid = batch["loss_mask"].bool() & batch["attention_mask"].bool()
    anchors, ok = sample_anchors(next_token_anchor_candidates(valid), 1, cfg.num_anchors, g)
    select = next_token_prefix_mask(valid, anchors, ok, BS)
    labels = block_labels(ids, anchors + 1, BS)[select]
    rows = model(batch["aux_hidden"], block_input_ids(ids, anchors, BS, 31), anchors, ok, block_labels(ids, anchors, BS),
                 select)
    b, j, k = select.nonzero(as_tuple=True)
    target = model.logits(batch["last_hidden"][b, (anchors[b, j] + k).clamp(max=ids.shape[1] - 1)])  # [N, V]
    logits = model.draft_logits(rows.hidden, rows.markov)  # [N, V]
    ce, _ = ce_rows(logits, labels, target, cfg, sampled_negatives(SPEC.vocab_size, cfg, logits.device, g))
    l1 = l1_rows(logits, target)
    conf = torch.zeros_like(l1) if rows.confidence is None else torch.nn.functional.binary_cross_entropy(
        rows.confidence.clamp(1e-6, 1 - 1e-6), torch.nan_to_num((1 - 0.5 * l1).detach(), nan=0.0).clamp(0, 1),
        reduction="none")
    row = cfg.ce_weight * ce + cfg.l1_weight * l1 + cfg.conf_weight * conf
    w = next_token_slot_weights(BS, cfg.loss_gamma).to(row.device)[k] * torch.isfinite(row)  # float32 as the objective
    return (w * torch.where(torch.isfinite(row), row, torch.zeros_like(row))).sum(), float(w.sum())


@pytest.mark.parametrize("chunk", [1, 4, 10_000])  # 4: a ragged last chunk; 10_000: one chunk
@pytest.mark.parametrize("settings", [{}, {"ce_mode": "restricted", "ce_vocab": 5}, {"ce_mode": "sampled", "ce_vocab": 7},
                                      {"markov_head_type": "gated"}, {"markov_rank": 0, "enable_confidence_head": False}],
                         ids=["full", "restricted", "sampled", "gated", "no_heads"])
def test_fused_loss_and_every_gradient_equal_plain_autograd_float64(settings: dict[str, object], chunk: int) -> None:
    """The objective (draft and target logits of each chunk once, d loss / d rows kept from the forward,
    common/fused_head.py) against `_unfused_reference` in float64: loss, weight sum, every gradient; rows
    with a non-finite target (NaN last hidden) dropped in both."""
    model = _model(loss_chunk_rows=chunk, **settings).double().train()
    batch = {key: v.double() if v.is_floating_point() else v for key, v in _batch().items()}
    batch["last_hidden"][0, 6] = float("nan")  # the rows reading position 6 are dropped (masked rows)
    params = [p for p in model.parameters() if p.requires_grad]
    out = dspark_objective(model, batch, torch.Generator().manual_seed(5))
    grads = torch.autograd.grad(out.numerators[0], params)
    ref, ref_den = _unfused_reference(model, batch, 5)
    assert out.metric_values()["nonfinite_rows"] > 0 and float(out.denominators[0]) == pytest.approx(ref_den, rel=1e-14)
    torch.testing.assert_close(out.numerators[0], ref, rtol=1e-12, atol=0.0)
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    for name, got, want in zip(names, grads, torch.autograd.grad(ref, params), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-13, msg=lambda m: f"{name}: {m}")  # noqa: B023
