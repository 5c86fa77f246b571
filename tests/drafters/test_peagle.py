"""P-EAGLE (drafters/peagle): the COD mask by hand, COD counts against the formula, the loss
against a slow per-element implementation, sequence partitioning's gradients, flex == SDPA,
parallel drafting == the training forward, and the export check.

The slow implementation scores each element (a, d) the way inference defines it: one causal
forward over the explicit rows the draft would see (the EAGLE-3 rows of a's document up to a,
then d mask rows), last row -> norm -> lm_head, soft CE against the target distribution at
a + 1 + d computed from the target head by hand. It shares no code with the COD layout, mask,
gathering or loss selection it checks.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
from fractions import Fraction
from pathlib import Path

import pytest
import torch
from drafter_targets import TinyTarget, tiny_spec
from safetensors.torch import load_file, save_file

from drafters.common.contract import DraftContext, StoreStats
from drafters.common.masks import dense_attention_mask
from drafters.common.sampling import SamplingParams
from drafters.common.vocab import token_counts_from_samples
from drafters.peagle import FAMILY, PEagleConfig, PEagleModel
from drafters.peagle.cod import (
    CODLayout,
    chain_valid,
    cod_attention_mask,
    cod_count,
    cod_sample,
    document_ids,
    segment_indices,
)
from drafters.peagle.export import check_export
from drafters.peagle.objective import peagle_objective

SPEC = dataclasses.replace(tiny_spec(vocab=32, hidden=16, layers=8, heads=4, kv_heads=2), mask_token_id=31)
AUX = (1, 3, 6)  # non-default (default (2, 4, 5))


def _rows(text: str) -> list[list[int]]:
    return [[int(c) for c in line.split()] for line in text.strip().splitlines()]


def test_cod_mask_two_documents_three_depths_by_hand() -> None:
    # one row, positions 0-2 document 0, 3-5 document 1; depth 1 kept anchors 0, 1, 3; depth 2 kept 0, 3;
    # the last element is row padding
    anchor = torch.tensor([[0, 1, 2, 3, 4, 5, 0, 1, 3, 0, 3, 0]])
    depth = torch.tensor([[0, 0, 0, 0, 0, 0, 1, 1, 1, 2, 2, 0]])
    exists = torch.tensor([[1] * 11 + [0]], dtype=torch.bool)
    layout = CODLayout(anchor, depth, exists, torch.tensor([[0, 0, 0, 1, 1, 1]]), torch.tensor([[6, 3, 2]]))
    want = _rows("""
        1 0 0 0 0 0 0 0 0 0 0 0
        1 1 0 0 0 0 0 0 0 0 0 0
        1 1 1 0 0 0 0 0 0 0 0 0
        0 0 0 1 0 0 0 0 0 0 0 0
        0 0 0 1 1 0 0 0 0 0 0 0
        0 0 0 1 1 1 0 0 0 0 0 0
        1 0 0 0 0 0 1 0 0 0 0 0
        1 1 0 0 0 0 0 1 0 0 0 0
        0 0 0 1 0 0 0 0 1 0 0 0
        1 0 0 0 0 0 1 0 0 1 0 0
        0 0 0 1 0 0 0 0 1 0 1 0
        0 0 0 0 0 0 0 0 0 0 0 1
    """)  # rows: (0,0) (1,0) (2,0) (3,0) (4,0) (5,0) (0,1) (1,1) (3,1) (0,2) (3,2) padding
    assert cod_attention_mask(layout).dense()[0, 0].int().tolist() == want
    # the same function through index tables (sequence partitioning): rows = the document-1 chain,
    # columns = the depth-0 keys then the segment's keys (-1: a padding column)
    q = torch.tensor([[8, 10, -1]])
    kv = torch.tensor([[0, 1, 2, 3, 4, 5, 8, 10, -1]])
    sub = cod_attention_mask(layout, q, kv).dense()[0, 0].int().tolist()
    assert sub == [[0, 0, 0, 1, 0, 0, 1, 0, 0], [0, 0, 0, 1, 0, 0, 1, 1, 0], [0, 0, 0, 0, 0, 0, 0, 0, 1]]
    assert [t.tolist() for t in segment_indices(layout, 2)] == [[[6, 7, 9]], [[8, 10]]]


def test_cod_counts_per_depth_against_the_formula() -> None:
    t, prompt = 200, 20
    loss = torch.zeros(2, t, dtype=torch.bool)
    loss[:, prompt:] = True
    loss[1, 150:] = False  # row 1 is shorter: fewer valid anchors
    attention = torch.ones(2, t, dtype=torch.bool)
    attention[1, 170:] = False
    doc = document_ids(attention)
    for r, r_min in ((0.7, 0.2), (0.8, 0.2), (0.5, 0.3)):
        layout = cod_sample(loss & attention, doc, 8, r, r_min, torch.Generator().manual_seed(0))
        for row in range(2):
            n_valid = int(chain_valid(loss & attention, doc, 0)[row].sum())
            assert n_valid == (t - prompt if row == 0 else 150 - prompt)  # anchors prompt-1.. : target a + 1 valid
            ratio = Fraction(str(r))
            kept = set(chain_valid(loss & attention, doc, 0)[row].nonzero().flatten().tolist())
            assert int(layout.counts[row, 0]) == int(attention[row].sum())  # depth 0: every real position
            for d in range(1, 8):
                frac = max(ratio ** d, Fraction(str(r_min)))
                budget = math.floor((n_valid - d) * frac)  # exact rational arithmetic: no float rounding
                assert cod_count(n_valid, d, r, r_min) == budget
                pool = {a for a in kept if a + 1 + d < t and bool((loss & attention)[row, a + 1 + d])}  # valid at d
                assert int(layout.counts[row, d]) == min(budget, len(pool)), (r, row, d)
                if d <= 2:
                    assert budget < len(pool)  # here the formula binds, not the pool
                sel = layout.exists[row] & (layout.depth[row] == d)
                now = set(layout.anchor[row][sel].tolist())
                assert now <= pool  # a random subset of the chains kept at d - 1 whose target at d is valid
                kept = now


def test_cod_pools_cap_the_budget_and_stay_inside_documents() -> None:
    valid = torch.ones(1, 12, dtype=torch.bool)
    doc = torch.tensor([[0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1]])
    layout = cod_sample(valid, doc, 5, 1.0, 0.0, torch.Generator().manual_seed(0))  # r = 1: keep every chain
    for d in range(1, 5):
        anchors = layout.anchor[0][layout.exists[0] & (layout.depth[0] == d)].tolist()
        # a chain (a, 0..d) needs a + 1 + d in a's document: doc 0 anchors 0..4-d, doc 1 anchors 6..10-d
        assert anchors == [*range(0, 5 - d), *range(6, 11 - d)]
        assert int(layout.counts[0, d]) == len(anchors) < cod_count(10, d, 1.0, 0.0)  # the pool binds
    with pytest.raises(ValueError, match="depth"):
        cod_count(10, 0, 0.7, 0.2)


def _trained_parts(num_layers: int = 2, dtype: torch.dtype = torch.float32,
                   **settings: object) -> tuple[TinyTarget, PEagleModel, dict[str, torch.Tensor]]:
    target = TinyTarget(SPEC, seed=0).eval()
    g = torch.Generator().manual_seed(1)
    samples = []
    for n in (21, 13, 17):
        ids = torch.randint(0, 31, (n,), generator=g)
        lm = torch.ones(n)
        lm[:4] = 0
        samples.append(target.features(ids, AUX, lm))
    cfg = FAMILY.resolve(PEagleConfig(num_layers=num_layers, num_depths=4, aux_layer_ids=AUX, draft_vocab_size=20,
                                      attn_backend="sdpa", **settings), SPEC)  # type: ignore[arg-type]
    torch.manual_seed(2)
    model = FAMILY.build(cfg, target.head(), StoreStats(token_counts=token_counts_from_samples(samples, 32)))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)  # non-unit norms
    batch = FAMILY.collate(samples)
    if dtype != torch.float32:
        model = model.to(dtype)
        batch = {k: v.to(dtype) if v.is_floating_point() else v for k, v in batch.items()}
    return target, model, batch


def _slow_element_logits(model: PEagleModel, batch: dict[str, torch.Tensor], b: int, a: int, d: int,
                         doc: torch.Tensor) -> torch.Tensor:
    """Draft logits [Vd] of element (a, d) of row b: a causal forward over the explicit rows."""
    start = int((doc[b] == doc[b, a]).nonzero()[0])
    ids, aux = batch["input_ids"][b], batch["aux_hidden"][b]
    rows = list(range(start, a + 1))
    tokens = torch.tensor([int(ids[r + 1]) for r in rows] + [model.mask_token_id] * d)
    feats = torch.cat([aux[rows].to(model.fc.weight.dtype), model.mask_hidden.expand(d, -1)])
    pos = torch.tensor(rows + list(range(a + 1, a + 1 + d)))
    n = tokens.numel()
    out, _ = model._layers(model.embed_tokens(tokens)[None], model.fc(feats)[None], pos[None],
                           dense_attention_mask(torch.ones(n, n, dtype=torch.bool).tril()), None)
    return model.lm_head(model.norm(out[0, -1]))


@pytest.mark.parametrize("chunk", [3, 10_000])  # 3: ragged chunks of loss rows; 10_000: one chunk
def test_loss_and_gradients_match_a_slow_per_element_implementation(chunk: int) -> None:
    """float64: the loss (target distributions computed once per position, `prepare_targets`) and every
    parameter gradient equal a slow per-element reference that rebuilds each element's target from the
    last hidden through the full target head."""
    _, model, batch = _trained_parts(dtype=torch.float64)
    model = FAMILY.with_settings(model, loss_chunk_rows=chunk)
    params = [p for p in model.parameters() if p.requires_grad]
    out = peagle_objective(model, batch, torch.Generator().manual_seed(5))
    grads = torch.autograd.grad(out.loss(), params)
    layout = cod_sample(batch["loss_mask"].bool() & batch["attention_mask"].bool(),
                        document_ids(batch["attention_mask"]), 4, 0.7, 0.2, torch.Generator().manual_seed(5))
    head, t2d = model.target_lm_head, model.t2d
    num = torch.zeros((), dtype=torch.float64)
    den = hits = 0
    per_depth = [0] * 4
    doc = document_ids(batch["attention_mask"])
    for b in range(layout.anchor.shape[0]):
        length = int(batch["attention_mask"][b].sum())
        for a, d, e in zip(layout.anchor[b].tolist(), layout.depth[b].tolist(), layout.exists[b].tolist()):
            p = a + 1 + d
            if not e or p >= length or not batch["loss_mask"][b, p]:
                continue
            target_logits = batch["last_hidden"][b, p] @ head.T  # [V]
            if not t2d[int(target_logits.argmax())]:
                continue  # the target's argmax is outside the draft vocab: masked
            probs = torch.softmax(target_logits[t2d], -1)
            logits = _slow_element_logits(model, batch, b, a, d, doc)
            num = num - (probs * torch.log_softmax(logits, -1)).sum()
            den += 1
            per_depth[d] += 1
            hits += int(int(model.d2t[int(logits.argmax())]) + int(logits.argmax()) == int(target_logits.argmax()))
    assert den > 20 and all(per_depth)  # every depth is scored
    torch.testing.assert_close(out.numerators[0], num, rtol=1e-12, atol=0.0)
    assert float(out.denominators[0]) == den
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    for name, got, want in zip(names, grads, torch.autograd.grad(num / den, params), strict=True):
        # the fused first layer and below: 2e-8, the same before the targets were computed once (the slow
        # per-element forward of that layer, not the loss); the loss side (lm_head, norm, layers): 1e-16
        tol = 1e-6 if name.split(".")[0] in ("mask_hidden", "fc", "midlayer") else 1e-12
        assert float((got - want).norm() / want.norm()) < tol, name
    assert float(out.metrics["acc"][0]) == hits and float(out.metrics["acc"][1]) == den
    assert [float(out.metrics[f"acc_pos{d}"][1]) for d in range(4)] == per_depth
    assert float(out.weights[0]) == 1.0 and out.numerators.shape == (1,)  # one count-normalised term


@pytest.mark.parametrize("segments", [2, 5])
def test_sequence_partitioning_gives_the_unpartitioned_gradients(segments: int) -> None:
    _, model, batch = _trained_parts(num_layers=3, dtype=torch.float64)
    grads = []
    losses = []
    for n in (1, segments):
        model.cfg = dataclasses.replace(model.cfg, num_segments=n)
        model.zero_grad()
        out = peagle_objective(model, batch, torch.Generator().manual_seed(3))
        out.loss().backward()
        losses.append(float(out.loss()))
        grads.append({k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None})
    assert abs(losses[0] - losses[1]) < 1e-12
    assert set(grads[0]) == set(grads[1]) and "mask_hidden" in grads[0] and "layers.2.mlp.up_proj.weight" in grads[0]
    for k in grads[0]:
        torch.testing.assert_close(grads[1][k], grads[0][k], rtol=1e-10, atol=1e-12)
    assert float(grads[0]["mask_hidden"].abs().sum()) > 0


def test_flex_attention_equals_sdpa_on_the_cod_mask() -> None:
    _, model, batch = _trained_parts()
    layout = cod_sample(batch["loss_mask"].bool() & batch["attention_mask"].bool(),
                        document_ids(batch["attention_mask"]), 4, 0.7, 0.2, torch.Generator().manual_seed(4))
    with torch.no_grad():
        sdpa = model(batch["input_ids"], batch["aux_hidden"], layout)
        model.cfg = dataclasses.replace(model.cfg, attn_backend="flex")
        flex = model(batch["input_ids"], batch["aux_hidden"], layout)
    real = layout.exists
    torch.testing.assert_close(flex[real], sdpa[real], rtol=1e-4, atol=1e-5)


def test_parallel_drafting_is_one_forward_equal_to_the_slow_elements() -> None:
    target, model, _ = _trained_parts()
    ids = torch.tensor([5, 9, 2, 14, 7, 3, 22])
    with torch.no_grad():
        out = target(ids[None], output_hidden_states=True)
    n = ids.numel() - 1
    ctx = DraftContext(ids, tuple(h[0, :n] for h in out.hidden_states))
    calls = []
    hook = model.register_forward_hook(lambda *_: calls.append(1))
    proposer = FAMILY.proposer(model, SPEC)
    logits = proposer.draft_logits(ctx, 4)
    hook.remove()
    assert len(calls) == 1  # K = 4 tokens from ONE draft forward
    batch = {"input_ids": ids[None], "aux_hidden": torch.cat([ctx.target_hidden_states[i] for i in AUX], -1)[None]}
    doc = torch.zeros(1, n + 1, dtype=torch.long)
    with torch.no_grad():
        for d in range(4):
            slow = _slow_element_logits(model, batch, 0, n - 1, d, doc)  # the training element (n - 1, d)
            target_vocab = torch.full((SPEC.vocab_size,), float("-inf"))
            target_vocab[torch.arange(slow.numel()) + model.d2t] = slow
            torch.testing.assert_close(logits[d], target_vocab)
    greedy = proposer.propose(ctx, 4, SamplingParams())
    assert greedy.token_ids.tolist() == logits.argmax(-1).tolist() and greedy.probs is None
    with pytest.raises(ValueError, match="num_depths=4"):
        proposer.propose(ctx, 5, SamplingParams())


def test_export_is_what_vllm_reads_and_the_check_refuses_damage(tmp_path: Path) -> None:
    target, model, _ = _trained_parts()
    cfg = model.cfg
    out = FAMILY.export(model, cfg, SPEC, tmp_path / "good")
    config = json.loads((out / "config.json").read_text())
    tensors = load_file(str(out / "model.safetensors"))
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["num_hidden_layers"] == 2
    assert config["mask_token_id"] == config["ptd_token_id"] == 31
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 3, 6]
    assert tensors["mask_hidden"].shape == (1, 3 * SPEC.hidden_size)
    assert torch.equal(tensors["mask_hidden"], model.mask_hidden.detach())
    assert torch.equal(tensors["layers.1.hidden_norm.weight"], tensors["layers.1.input_layernorm.weight"])
    assert "layers.1.hidden_norm.weight" not in model.state_dict()  # a twin for the engines, not a parameter
    fmt = FAMILY.engine_format(cfg, SPEC)
    spec = fmt.vllm_speculative_config(out, 3)
    assert spec == {"method": "eagle3", "model": str(out), "num_speculative_tokens": 3, "parallel_drafting": True}
    with pytest.raises(ValueError, match="1..4"):
        fmt.vllm_speculative_config(out, 5)
    with pytest.raises(ValueError, match="SGLang 0.5.23 has no P-EAGLE"):
        fmt.sglang_server_args(out, 3)
    assert check_export(out).mask_token_id == 31

    def damaged(name: str) -> Path:
        dst = tmp_path / name
        shutil.copytree(out, dst)
        return dst

    no_mask = damaged("no_mask_hidden")
    t = load_file(str(no_mask / "model.safetensors"))
    del t["mask_hidden"]
    save_file(t, str(no_mask / "model.safetensors"))
    with pytest.raises(ValueError, match=r"no 'mask_hidden' tensor \(expected shape \(1, 48\)\)"):
        FAMILY.load_export(no_mask, target.head())

    no_id = damaged("no_mask_id")
    c = json.loads((no_id / "config.json").read_text())
    del c["mask_token_id"], c["ptd_token_id"]
    (no_id / "config.json").write_text(json.dumps(c))
    with pytest.raises(ValueError, match="no mask token id"):
        check_export(no_id)

    wrong = damaged("wrong_size")
    t = load_file(str(wrong / "model.safetensors"))
    t["mask_hidden"] = t["mask_hidden"][:, :32].contiguous()
    save_file(t, str(wrong / "model.safetensors"))
    with pytest.raises(ValueError, match=r"mask_hidden: shape \(1, 32\), expected \(1, 48\)"):
        check_export(wrong)

    twin = damaged("twin_differs")
    t = load_file(str(twin / "model.safetensors"))
    t["layers.1.hidden_norm.weight"] = t["layers.1.hidden_norm.weight"] + 1
    save_file(t, str(twin / "model.safetensors"))
    with pytest.raises(ValueError, match="layers.1.hidden_norm.weight must be present and equal"):
        check_export(twin)

    with pytest.raises(ValueError, match="missing 'mask_hidden'"):
        fmt.engine_tensors({k: v for k, v in model.state_dict().items() if k != "mask_hidden"})


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="cod_ratio: got 1.5"):
        PEagleConfig(cod_ratio=1.5)
    with pytest.raises(ValueError, match="num_depths: got 0"):
        PEagleConfig(num_depths=0)
    with pytest.raises(ValueError, match="num_segments: got 0"):
        PEagleConfig(num_segments=0)
    no_mask = dataclasses.replace(SPEC, mask_token_id=None)
    with pytest.raises(ValueError, match="mask_token_id: None and the target tokenizer has no mask token"):
        PEagleConfig(aux_layer_ids=AUX).resolve(no_mask)
    with pytest.raises(ValueError, match="mask_token_id: got 32, expected 0..31"):
        PEagleConfig(aux_layer_ids=AUX, mask_token_id=32).resolve(SPEC)
    assert FAMILY.required_layout(PEagleConfig(), no_mask).layer_ids == (2, 4, 5)  # the layout needs no mask id


@pytest.mark.parametrize("segment", [False, True])
def test_structured_cod_attention_equals_dense_sdpa_forward_and_backward(segment: bool) -> None:
    """The CPU fast path (depth-0 block by flash attention + gathered chain keys) against SDPA over
    the mask function's dense matrix, on a padded two-row COD sample; for a partitioned pass too."""
    import torch.nn.functional as F

    from drafters.common.attention import BlockGatherMask, attend, block_gather_sdpa
    from drafters.peagle.cod import cod_structured_mask

    valid = torch.ones(2, 14, dtype=torch.bool)
    valid[0, :3] = False
    attention = torch.ones(2, 14, dtype=torch.bool)
    attention[1, 9:] = False
    doc = document_ids(attention, torch.tensor([[0] * 7 + [1] * 7, [0] * 14]))
    layout = cod_sample(valid & attention, doc, 4, 0.7, 0.2, torch.Generator().manual_seed(0))
    t = layout.seq_len
    if segment:
        q_index = segment_indices(layout, 2)[1]
        kv_index = torch.cat([torch.arange(t).expand(2, t), q_index], 1)
        real = (q_index >= 0) & torch.gather(layout.exists, 1, q_index.clamp(min=0))
    else:
        q_index = kv_index = None
        real = layout.exists
    mask = cod_structured_mask(layout, q_index, kv_index)
    assert isinstance(mask, BlockGatherMask) and int((mask.gather_index >= 0).sum()) > 0
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 4, mask.q_len, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(2, 2, mask.kv_len, 8, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(2, 2, mask.kv_len, 8, generator=g, dtype=torch.float64, requires_grad=True)
    w = torch.randn(2, 4, mask.q_len, 8, generator=g, dtype=torch.float64) * real[:, None, :, None]
    outs, grads = [], []
    for fn in (lambda: block_gather_sdpa(q, k, v, mask),
               lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask.dense(), enable_gqa=True)):
        out = fn()
        (out * w).sum().backward()  # padding rows carry no gradient, as in training
        outs.append(out.detach())
        grads.append([x.grad.clone() for x in (q, k, v)])  # type: ignore[union-attr]
        for x in (q, k, v):
            x.grad = None
    r = real[:, None, :, None].expand_as(outs[0])
    torch.testing.assert_close(outs[0][r], outs[1][r], rtol=1e-10, atol=1e-12)
    for a, b in zip(grads[0], grads[1]):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)
    with torch.no_grad():
        torch.testing.assert_close(attend(q, k, v, mask, "sdpa")[r], outs[1][r], rtol=1e-10, atol=1e-12)
