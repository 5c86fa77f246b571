"""EAGLE-3 model, objective and family on tiny random targets."""

from __future__ import annotations

import math
import warnings
from dataclasses import replace

import pytest
import torch
from drafter_targets import TinyTarget, tiny_spec

from drafters.common.contract import StoreStats
from drafters.common.target import TargetHead
from drafters.common.vocab import DraftVocab, target_logits_to_draft, token_counts
from drafters.eagle3 import FAMILY, Eagle3Config, Eagle3Model
from drafters.eagle3.objective import prepare_targets, step_input_ids
from feature_store import Layout

AUX = (1, 2, 3)


def _batch(target: TinyTarget, lengths: tuple[int, ...], seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    samples = []
    for n in lengths:
        ids = torch.randint(0, target.spec.vocab_size, (n,), generator=g)
        mask = torch.ones(n, dtype=torch.uint8)
        mask[: n // 3] = 0  # a "prompt"
        samples.append(target.features(ids, AUX, mask))
    return FAMILY.collate(samples)


def _model(target: TinyTarget, steps: int = 3, vd: int | None = 24, **kw: object) -> Eagle3Model:
    counts = torch.arange(target.spec.vocab_size).flip(0)  # low ids most frequent -> draft vocab = 0..vd-1
    cfg = Eagle3Config(draft_vocab_size=vd, aux_layer_ids=AUX, ttt_steps=steps, attn_backend="sdpa", **kw)  # type: ignore[arg-type]
    torch.manual_seed(1)
    return FAMILY.build(cfg, target.head(), StoreStats(counts))


def test_parameter_names_are_the_export_contract() -> None:
    target = TinyTarget(tiny_spec())
    model = _model(target, num_layers=2)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    h, v = 16, 32
    assert shapes == {
        "fc.weight": (h, 3 * h),
        "midlayer.hidden_norm.weight": (h,), "midlayer.input_layernorm.weight": (h,),
        "midlayer.post_attention_layernorm.weight": (h,),
        "midlayer.self_attn.q_proj.weight": (16, 2 * h), "midlayer.self_attn.k_proj.weight": (8, 2 * h),
        "midlayer.self_attn.v_proj.weight": (8, 2 * h), "midlayer.self_attn.o_proj.weight": (h, 16),
        "midlayer.mlp.gate_proj.weight": (32, h), "midlayer.mlp.up_proj.weight": (32, h),
        "midlayer.mlp.down_proj.weight": (h, 32),
        "layers.1.input_layernorm.weight": (h,), "layers.1.post_attention_layernorm.weight": (h,),
        "layers.1.self_attn.q_proj.weight": (16, h), "layers.1.self_attn.k_proj.weight": (8, h),
        "layers.1.self_attn.v_proj.weight": (8, h), "layers.1.self_attn.o_proj.weight": (h, 16),
        "layers.1.mlp.gate_proj.weight": (32, h), "layers.1.mlp.up_proj.weight": (32, h),
        "layers.1.mlp.down_proj.weight": (h, 32),
        "norm.weight": (h,), "lm_head.weight": (24, h), "embed_tokens.weight": (v, h), "d2t": (24,), "t2d": (v,),
    }
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert "embed_tokens.weight" not in trainable and "lm_head.weight" in trainable
    assert "target_lm_head" not in shapes and torch.equal(model.target_lm_head, target.lm_head.weight)
    assert torch.equal(model.embed_tokens.weight, target.embed_tokens.weight)
    assert model.d2t.tolist() == [0] * 24 and model.t2d.tolist() == [True] * 24 + [False] * 8


def test_shift_alignment_golden() -> None:
    spec = tiny_spec(vocab=8, hidden=8, layers=4, heads=2, kv_heads=1)
    head = TargetHead(spec, torch.randn(8, 8), torch.eye(8), torch.ones(8))  # target logits = last_hidden
    vocab = DraftVocab.from_target_ids(torch.arange(7), 8)  # token 7 is outside the draft vocab
    model = Eagle3Model(Eagle3Config(draft_vocab_size=7, aux_layer_ids=(1,), ttt_steps=2).resolve(spec), head, vocab)
    argmax = torch.tensor([[2, 3, 7, 5, 6], [4, 5, 6, 0, 0]])
    batch = {"input_ids": torch.tensor([[1, 2, 3, 4, 5], [3, 4, 5, 0, 0]]),
             "loss_mask": torch.tensor([[0, 1, 1, 1, 1], [0, 1, 1, 0, 0]]),
             "attention_mask": torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]], dtype=torch.bool),
             "last_hidden": 4.0 * torch.nn.functional.one_hot(argmax, 8).float()}
    batch["last_hidden"][1, 3:] = 0.0
    targets = prepare_targets(model, batch)
    assert step_input_ids(batch["input_ids"], 2).tolist() == [[[2, 3, 4, 5, 0], [4, 5, 0, 0, 0]],
                                                              [[3, 4, 5, 0, 0], [5, 0, 0, 0, 0]]]
    expected_masks = [[[1, 0, 1, 1, 0], [1, 1, 0, 0, 0]], [[0, 1, 1, 0, 0], [1, 0, 0, 0, 0]]]
    expected_argmax = [[[3, 7, 5, 6, 0], [5, 6, 0, 0, 0]], [[7, 5, 6, 0, 0], [6, 0, 0, 0, 0]]]
    for j in range(2):
        am, mask = targets.at_step(j)
        assert mask.int().tolist() == expected_masks[j]
        assert am.tolist() == expected_argmax[j]
    b, t, prob_rows, _ = targets.rows_at_step(0)
    assert (int(b[0]), int(t[0])) == (0, 0)
    probs0 = targets.probs[prob_rows]  # the targets the loss reads, computed once per position
    want = target_logits_to_draft(model.target_logits(batch["last_hidden"][b, t + 1]), model.t2d)  # [N, Vd]
    torch.testing.assert_close(probs0, torch.softmax(want, -1))
    row = torch.tensor([0.0, 0.0, 0.0, 4.0, 0.0, 0.0, 0.0])  # b0 step 0 row 0 = position 1 (argmax 3), no token 7
    torch.testing.assert_close(probs0[0], torch.softmax(row, -1))


def test_objective_matches_explicit_loop() -> None:
    target = TinyTarget(tiny_spec())
    model = _model(target, steps=3)
    batch = _batch(target, (9, 6))
    out = FAMILY.objective(model, batch)
    with torch.no_grad():
        logits = model(step_input_ids(batch["input_ids"], 3), batch["aux_hidden"], batch["attention_mask"])
        target_logits = batch["last_hidden"] @ target.lm_head.weight.T
    t2d = model.t2d
    for j in range(3):
        num, den, hits = 0.0, 0, 0
        for b, n in enumerate(batch["lengths"].tolist()):
            for t in range(n):
                p = t + 1 + j  # step j row t is scored against the target at position t + 1 + j
                if p >= n or not batch["loss_mask"][b, p] or not t2d[target_logits[b, p].argmax()]:
                    continue
                tp = torch.softmax(target_logits[b, p][t2d], -1)
                z = logits[j][b, t].tolist()
                lse = math.log(sum(math.exp(x) for x in z))
                num += -sum(float(tp[v]) * (z[v] - lse) for v in range(len(z)))
                den += 1
                hits += int(logits[j][b, t].argmax() == target_logits[b, p].argmax())  # identity d2t on 0..23
        assert abs(float(out.numerators[j].detach()) - num) < 1e-4 and float(out.denominators[j]) == den
        assert [float(x) for x in out.metrics[f"acc_step{j}"]] == [hits, den]
    torch.testing.assert_close(out.weights, torch.tensor([1.0, 0.8, 0.64]))
    assert out.numerators.requires_grad and not out.denominators.requires_grad


@pytest.mark.parametrize("num_layers,norm_before_residual", [(1, False), (2, True)])
def test_step_api_reproduces_ttt_rows(num_layers: int, norm_before_residual: bool) -> None:
    target = TinyTarget(tiny_spec())
    model = _model(target, steps=4, num_layers=num_layers, norm_before_residual=norm_before_residual)
    batch = _batch(target, (10,))
    with torch.no_grad():
        ttt = model(step_input_ids(batch["input_ids"], 4), batch["aux_hidden"], batch["attention_mask"])
    ids, aux = batch["input_ids"][0], batch["aux_hidden"][0]
    for n in (3, 6):  # committed x_0..x_n, features f_0..f_{n-1}: TTT row n - 1
        state = model.prefill(ids[1 : n + 1][None], aux[:n][None])
        for j in range(4):
            torch.testing.assert_close(state.logits[0], ttt[j][0, n - 1], atol=1e-5, rtol=1e-5)
            if n + 1 + j < 10:
                state = model.step(state, ids[n + 1 + j].view(1))  # teacher-forced token x_{n+1+j}


def test_flex_forward_matches_sdpa_in_the_model() -> None:
    target = TinyTarget(tiny_spec())
    model = _model(target, steps=2)
    batch = _batch(target, (7, 4))
    ids = step_input_ids(batch["input_ids"], 2)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sdpa = model(ids, batch["aux_hidden"], batch["attention_mask"])
        model.cfg = replace(model.cfg, attn_backend="flex")
        flex = model(ids, batch["aux_hidden"], batch["attention_mask"])
    for a, b in zip(sdpa, flex):
        valid = batch["attention_mask"]
        torch.testing.assert_close(a[valid], b[valid], atol=1e-5, rtol=1e-5)


def test_training_steps_reduce_loss() -> None:
    target = TinyTarget(tiny_spec())
    model = _model(target, steps=3)
    batch = _batch(target, (12, 9, 7), seed=5)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    losses = []
    for _ in range(30):
        loss = FAMILY.objective(model, batch).loss()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[1] < losses[0] and losses[-1] < 0.6 * losses[0], losses
    assert model.embed_tokens.weight.grad is None  # frozen embedding never gets a gradient


def test_build_vocab_layout_and_init() -> None:
    target = TinyTarget(tiny_spec())
    head = target.head()
    with pytest.raises(ValueError, match="needs store_stats.token_counts"):
        FAMILY.build(Eagle3Config(draft_vocab_size=10, aux_layer_ids=AUX), head)
    ids = torch.tensor([5, 5, 5, 9, 9, 1, 2, 3, 4])
    counts = token_counts(ids, torch.ones(9), 32)
    model = FAMILY.build(Eagle3Config(draft_vocab_size=3, aux_layer_ids=AUX, lm_head_init="target"), head,
                         StoreStats(counts))
    assert model.draft_vocab.target_ids.tolist() == [1, 5, 9]
    torch.testing.assert_close(model.lm_head.weight, head.lm_head[[1, 5, 9]])
    deep = TinyTarget(tiny_spec(layers=8)).head()
    full = FAMILY.build(Eagle3Config(), deep)
    assert full.cfg.aux_layer_ids == (2, 4, 5) and full.draft_vocab.is_full and full.cfg.ttt_steps == 7
    assert FAMILY.required_layout(Eagle3Config(), deep.spec) == Layout(layer_ids=(2, 4, 5), last_hidden="post_norm")
    assert FAMILY.required_fields(Eagle3Config()) == ("input_ids", "loss_mask", "aux_hidden", "last_hidden")
    with pytest.raises(ValueError, match="at least 7 layers"):  # 4 layers: defaults (2, 2, 1) collide
        FAMILY.build(Eagle3Config(), head)
    for bad in ((1, 4), (2, 1, 3), (0, 1, 2)):
        with pytest.raises(ValueError, match=r"strictly increasing ids within 1\.\.3"):
            FAMILY.build(Eagle3Config(aux_layer_ids=bad), head)
