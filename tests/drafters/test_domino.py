"""Domino (drafters/domino): curriculum, layout, objective against a slow per-row loop, the GRU
rollout of the proposer against the teacher-forced training forward, export and its refusals."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from drafter_targets import damaged_copy, tiny_spec
from safetensors.torch import load_file

from drafters.common.blocks import (
    block_input_ids,
    next_token_anchor_candidates,
    next_token_prefix_mask,
    sample_anchors,
)
from drafters.common.contract import DraftContext
from drafters.common.sampling import SamplingParams
from drafters.common.target import TargetHead
from drafters.dflash.export import check_export
from drafters.domino import FAMILY
from drafters.domino.config import DominoConfig, curriculum_lambda
from drafters.domino.export import DominoExportConfig
from drafters.domino.model import DominoDraft
from drafters.domino.objective import domino_objective
from drafters.domino.proposer import DominoProposer

SPEC = tiny_spec(vocab=32, hidden=16, layers=8, heads=4, kv_heads=2)
BS = 4  # 3 drafts per block


def _head(seed: int = 0) -> TargetHead:
    g = torch.Generator().manual_seed(seed)
    return TargetHead(SPEC, torch.randn(32, 16, generator=g), torch.randn(32, 16, generator=g), torch.ones(16))


def _model(seed: int = 0, **kw: Any) -> DominoDraft:
    torch.manual_seed(seed)
    cfg = DominoConfig(num_layers=2, block_size=BS, target_layer_ids=(1, 5), num_target_features=2, mask_token_id=31,
                       gru_hidden_dim=6, emb_dim=5, attn_backend="sdpa", **kw)
    model = DominoDraft(cfg, _head())
    with torch.no_grad():  # a head far from its init: the correction matters in every comparison
        model.embed_proj[2].weight.normal_(0.0, 1.0)
    return model


def test_curriculum_lambda_golden() -> None:
    cfg = DominoConfig(lambda_start=1.0, lambda_decay_fraction=0.5)
    assert [curriculum_lambda(cfg, p) for p in (0.0, 0.25, 0.5, 0.9, 1.0)] == [1.0, 0.5, 0.0, 0.0, 0.0]
    assert curriculum_lambda(DominoConfig(lambda_decay_fraction=0.0), 0.0) == 0.0
    assert curriculum_lambda(DominoConfig(lambda_start=0.8, lambda_decay_fraction=1.0), 0.5) == pytest.approx(0.4)
    with pytest.raises(ValueError, match="progress: got 1.5"):
        curriculum_lambda(cfg, 1.5)
    for bad, message in [({"lambda_decay_fraction": 1.5}, "lambda_decay_fraction: got 1.5"),
                         ({"gru_hidden_dim": 0}, "gru_hidden_dim: got 0"), ({"emb_dim": -1}, "emb_dim: got -1"),
                         ({"lambda_start": 2.0}, "lambda_start: got 2.0")]:
        with pytest.raises(ValueError, match=message):
            DominoConfig(**bad)


def test_layout_golden() -> None:
    """B 4 (3 drafting slots), valid [1, 1, 1, 0, 1, 1], anchors 0 and 4 (a 2-token tail)."""
    valid = torch.tensor([[1, 1, 1, 0, 1, 1]], dtype=torch.bool)
    assert next_token_anchor_candidates(valid).int().tolist() == [[1, 1, 0, 0, 1, 0]]
    anchors, ok = torch.tensor([[0, 4]]), torch.tensor([[True, True]])
    # anchor 0: labels x1, x2, x3 -> [1, 1, 0]; anchor 4: labels x5, x6 (past the end), x7 -> [1, 0, 0]
    select = next_token_prefix_mask(valid, anchors, ok, BS)[:, :, : BS - 1]
    assert select.int().tolist() == [[[1, 1, 0], [1, 0, 0]]]


def _batch(seed: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    b, t = 2, 12
    mask = torch.ones(b, t, dtype=torch.uint8)
    mask[:, :2] = 0
    mask[1, 7] = 0  # a hole: runs through position 7 are cut
    attn = torch.ones(b, t, dtype=torch.bool)
    attn[1, 10:] = False
    mask[1, 10:] = 0
    return {"input_ids": torch.randint(0, 31, (b, t), generator=g), "loss_mask": mask, "attention_mask": attn,
            "aux_hidden": torch.randn(b, t, 32, generator=g)}


def _slow(model: DominoDraft, batch: dict[str, torch.Tensor], seed: int, lam: float) -> tuple[float, float]:
    """Per sequence, anchor and slot: the backbone hidden of the block, a GRU CELL stepped by hand
    over the embeddings of x_a .. x_{a+k} (torch.nn.GRUCell with prefix_gru's weights), the head
    on [h_k ; g_k], CE in Python arithmetic."""
    cfg = model.cfg
    ids, valid = batch["input_ids"], batch["loss_mask"].bool() & batch["attention_mask"]
    seq = valid.shape[1]
    g = torch.Generator().manual_seed(seed)
    cand = torch.zeros_like(valid)
    for i in range(valid.shape[0]):
        for a in range(seq - 1):
            cand[i, a] = bool(valid[i, a]) and bool(valid[i, a + 1])
    anchors, ok = sample_anchors(cand, 1, cfg.num_anchors, g)
    hidden = model.block_hidden(batch["aux_hidden"], block_input_ids(ids, anchors, BS, 31), anchors, ok)
    cell = torch.nn.GRUCell(16, cfg.gru_hidden_dim, bias=False)
    cell.weight_ih.data.copy_(model.prefix_gru.weight_ih_l0)
    cell.weight_hh.data.copy_(model.prefix_gru.weight_hh_l0)
    num = den = 0.0
    for i in range(ids.shape[0]):
        for j in range(anchors.shape[1]):
            if not ok[i, j]:
                continue
            a = int(anchors[i, j])
            state = torch.zeros(1, cfg.gru_hidden_dim)
            for k in range(BS - 1):
                state = cell(model.target_embed_tokens[ids[i, a + k]][None], state)  # after x_a .. x_{a+k}
                if not all(a + q + 1 < seq and bool(valid[i, a + q + 1]) for q in range(k + 1)):
                    break
                h = hidden[i, j, k]
                base = (model.target_lm_head @ h).tolist()
                final = base if k == 0 else (model.target_lm_head @ h + model.embed_proj(
                    torch.cat([h, state[0]]))).tolist()
                label = int(ids[i, a + k + 1])

                w = math.exp(-k / cfg.loss_gamma)
                num += w * ((1 - lam) * _ce(final, label) + lam * _ce(base, label))
                den += w
    return num, den


def _ce(z: list[float], label: int) -> float:
    return math.log(sum(math.exp(v) for v in z)) - z[label]


@pytest.mark.parametrize("progress", [0.0, 0.2, 1.0])
def test_objective_matches_a_slow_loop(progress: float) -> None:
    model = _model(lambda_decay_fraction=0.5).eval()
    batch = _batch()
    lam = curriculum_lambda(model.cfg, progress)
    with torch.no_grad():
        out = domino_objective(model, batch, progress, torch.Generator().manual_seed(3))
        num, den = _slow(model, batch, 3, lam)
    assert den > 0
    assert float(out.denominators[0]) == pytest.approx(den, rel=1e-5)
    assert float(out.numerators[0]) == pytest.approx(num, rel=1e-4)
    assert float(out.metrics["lambda"][0]) == pytest.approx(lam)


def test_curriculum_moves_the_gradient_from_backbone_only_to_the_head() -> None:
    """lam = 1 trains the base logits only: the correction head gets no gradient; lam = 0 trains it."""
    for progress, head_grad in ((0.0, False), (1.0, True)):
        model = _model(lambda_decay_fraction=0.5)
        domino_objective(model, _batch(), progress, torch.Generator().manual_seed(3)).loss().backward()
        grads = [p.grad for p in (*model.prefix_gru.parameters(), *model.embed_proj.parameters())]
        nonzero = any(gr is not None and bool(gr.abs().sum() > 0) for gr in grads)
        assert nonzero == head_grad, progress
        assert model.fc.weight.grad is not None and bool(model.fc.weight.grad.abs().sum() > 0)


def _ctx(model: DominoDraft, n: int, seed: int = 5) -> DraftContext:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 31, (n + 1,), generator=g)
    states = tuple(torch.randn(n, 16, generator=g) for _ in range(SPEC.num_hidden_layers + 1))
    return DraftContext(token_ids=ids, target_hidden_states=states)


def test_greedy_rollout_equals_the_teacher_forced_forward_on_its_own_drafts() -> None:
    """The proposer's step-by-step GRU (SGLang's rollout) and the training forward fed the drafts
    as teacher-forced inputs must agree: each draft is the argmax of the final logits there."""
    model = _model().eval()
    ctx = _ctx(model, 7)
    drafts = DominoProposer(model).propose(ctx, BS - 1, SamplingParams()).token_ids
    n = ctx.token_ids.numel() - 1
    features = torch.cat([ctx.target_hidden_states[i] for i in model.cfg.hidden_state_ids(SPEC)], -1)[None]
    block = block_input_ids(ctx.token_ids[None], torch.tensor([[n]]), BS, 31)
    prev = torch.cat([ctx.token_ids[-1:], drafts[:-1]])[None, None]  # t_0 = x_n, t_k = d_k
    with torch.no_grad():
        h, g = model(features, block, torch.tensor([[n]]), torch.tensor([[True]]), prev,
                     torch.ones(1, 1, BS - 1, dtype=torch.bool))
        base, final = model.row_logits(h, g, torch.arange(BS - 1))
    assert final.argmax(-1).tolist() == drafts.tolist()
    assert not torch.equal(final[1:].argmax(-1), base[1:].argmax(-1)) or not torch.allclose(final[1:], base[1:])
    torch.testing.assert_close(final[0], base[0])  # slot 0 keeps the base logits
    # sampling: the reported q_k must be softmax of the final logits given the drafts before it
    sampled = DominoProposer(model).propose(ctx, BS - 1, SamplingParams(temperature=1.0),
                                            torch.Generator().manual_seed(0))
    assert sampled.probs is not None and sampled.probs.shape == (BS - 1, 32)
    prev = torch.cat([ctx.token_ids[-1:], sampled.token_ids[:-1]])[None, None]
    with torch.no_grad():
        h, g = model(features, block, torch.tensor([[n]]), torch.tensor([[True]]), prev,
                     torch.ones(1, 1, BS - 1, dtype=torch.bool))
        _, final = model.row_logits(h, g, torch.arange(BS - 1))
    torch.testing.assert_close(sampled.probs, torch.softmax(final.float(), -1))
    with pytest.raises(ValueError, match="1 <= num_tokens <= block_size - 1 = 3"):
        DominoProposer(model).propose(ctx, 4, SamplingParams())


def test_export_keys_round_trip_engine_args_and_refusals(tmp_path: Path) -> None:
    model = _model().eval()
    out = FAMILY.export(model, model.cfg, SPEC, tmp_path / "ok")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"] and "eagle_config" not in config
    d = config["dflash_config"]
    assert (d["projector_type"], d["shift_label"], d["pure_draft_prefix_len"], d["gru_hidden_dim"], d["emb_dim"]) == \
        ("domino", True, 1, 6, 5)
    assert config["emb_dim"] == 5 and config["block_size"] == BS
    assert d["target_layer_ids"] == [1, 5] and config["eagle_aux_hidden_state_layer_ids"] == [2, 6]
    shapes = {k: tuple(v.shape) for k, v in load_file(str(out / "model.safetensors")).items()}
    assert shapes["prefix_gru.weight_ih_l0"] == (18, 16) and shapes["prefix_gru.weight_hh_l0"] == (18, 6)
    assert shapes["embed_proj.0.weight"] == (5, 22) and shapes["embed_proj.2.weight"] == (32, 5)
    loaded = FAMILY.load_export(out, _head())
    for key, value in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[key], value), key

    fmt = FAMILY.engine_format(model.cfg, SPEC)
    with pytest.raises(ValueError, match="vLLM 0.32 has no Domino.*plain DFlash silently"):
        fmt.vllm_speculative_config(out, BS - 1)
    with pytest.raises(ValueError, match="export dtype 'float32', expected 'bfloat16'"):
        fmt.sglang_server_args(out, BS - 1)
    bf16 = FAMILY.export(model, model.cfg, SPEC, tmp_path / "bf16", dtype=torch.bfloat16)
    served = check_export(bf16, DominoExportConfig)
    assert served.sglang_server_args(bf16, BS - 1) == {
        "speculative_algorithm": "DFLASH", "speculative_draft_model_path": str(bf16), "speculative_num_draft_tokens": BS}
    with pytest.raises(ValueError, match="num_speculative_tokens=4, expected block_size - 1 = 3"):
        served.sglang_server_args(bf16, 4)

    def damaged(name: str, edit_config: Any = None, edit_tensors: Any = None) -> Path:
        return damaged_copy(out, tmp_path / name, edit_config, edit_tensors)

    cases = [
        (damaged("no_projector", edit_config=lambda c: c["dflash_config"].pop("projector_type")),
         r"missing keys \['dflash_config.projector_type'\].*plain DFlash"),
        (damaged("emb_disagrees", edit_config=lambda c: c.update(emb_dim=7)), r"key 'emb_dim' = 7, expected 5"),
        (damaged("no_shift", edit_config=lambda c: c["dflash_config"].update(shift_label=False)),
         "key 'dflash_config' = .*expected"),
        (damaged("no_gru", edit_tensors=lambda t: t.pop("prefix_gru.weight_hh_l0")),
         r"missing tensors \['prefix_gru.weight_hh_l0'\]"),
        (damaged("gru_width", edit_tensors=lambda t: t.update({"embed_proj.0.weight": torch.zeros(5, 20)})),
         r"'embed_proj.0.weight' has shape \(5, 20\), expected \(5, 22\)"),
    ]
    for bad, message in cases:
        with pytest.raises(ValueError, match=message):
            check_export(bad, DominoExportConfig)
