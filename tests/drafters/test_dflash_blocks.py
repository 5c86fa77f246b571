"""Block-drafting numerics (common/blocks.py) and the DFlash backbone, pinned by hand-written
masks and a slow per-block reference."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from drafter_targets import tiny_spec

from drafters.common.blocks import (
    block_input_ids,
    block_labels,
    block_mask_mod,
    block_position_ids,
    context_position_ids,
    dense_block_mask,
    flex_block_mask,
    sample_anchors,
)
from drafters.common.target import TargetHead
from drafters.dflash import DFlashConfig, DFlashDraft
from drafters.dflash.model import DFlashDecoderLayer


def _m(rows: list[str]) -> torch.Tensor:
    return torch.tensor([[c == "1" for c in r.replace(" ", "")] for r in rows])


GOLDEN = _m(["100000 111 000", "100000 111 000", "100000 111 000",
             "111000 000 111", "111000 000 111", "111000 000 111"])


def test_dense_block_mask_golden() -> None:
    anchors = torch.tensor([[1, 3], [2, 0]])
    valid = torch.tensor([[True, True], [True, False]])
    dense = dense_block_mask(anchors, valid, 6, 3)
    assert dense.shape == (2, 1, 6, 12) and dense.dtype == torch.bool
    assert torch.equal(dense[0, 0], GOLDEN)
    # row 1: block 0 at anchor 2; block 1 is padding: its own block only (never an empty row)
    assert torch.equal(dense[1, 0], _m(["110000 111 000", "110000 111 000", "110000 111 000",
                                        "000000 000 111", "000000 000 111", "000000 000 111"]))
    assert bool(dense.any(-1).all())


def test_mask_function_pointwise_equals_dense() -> None:
    g = torch.Generator().manual_seed(3)
    anchors, valid = sample_anchors(torch.rand(3, 11, generator=g) > 0.3, 4, 3, g)
    mod = block_mask_mod(anchors, valid, 11, 4)
    dense = dense_block_mask(anchors, valid, 11, 4)
    zero = torch.tensor(0)
    for b in range(3):
        for q in range(12):
            for kv in range(11 + 12):
                got = bool(mod(torch.tensor(b), zero, torch.tensor(q), torch.tensor(kv)))
                assert got == bool(dense[b, 0, q, kv]), (b, q, kv)
    # the worked example of the docstring
    mod = block_mask_mod(torch.tensor([[1, 3]]), torch.tensor([[True, True]]), 6, 3)
    t = torch.tensor
    assert [bool(mod(t(0), zero, t(q), t(kv))) for q, kv in ((4, 2), (4, 3), (4, 9), (0, 9))] == \
        [True, False, True, False]


def test_position_ids_and_block_tokens_golden() -> None:
    anchors = torch.tensor([[1, 3], [0, 4]])
    assert block_position_ids(anchors, 3).tolist() == [[1, 2, 3, 3, 4, 5], [0, 1, 2, 4, 5, 6]]
    assert context_position_ids(2, 3).tolist() == [[0, 1, 2], [0, 1, 2]]
    ids = torch.tensor([[5, 6, 7, 8]])
    assert block_input_ids(ids, torch.tensor([[1, 2]]), 3, 9).tolist() == [[[6, 9, 9], [7, 9, 9]]]
    assert block_labels(ids, torch.tensor([[1, 2]]), 3).tolist() == [[[6, 7, 8], [7, 8, 0]]]


def test_flex_block_mask_matches_dense() -> None:
    from torch.nn.attention.flex_attention import flex_attention

    anchors, valid = torch.tensor([[1, 3], [2, 0]]), torch.tensor([[True, True], [True, False]])
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, n, 8, generator=g) for n in (6, 12, 12))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        bm = flex_block_mask(anchors, valid, 6, 3)
        out = flex_attention(q, k, v, block_mask=bm)
    assert isinstance(out, torch.Tensor)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=dense_block_mask(anchors, valid, 6, 3))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_sample_anchors_candidates_padding_and_determinism() -> None:
    valid = torch.zeros(3, 20, dtype=torch.bool)
    valid[0, 2:18] = True  # length 18, B 4: candidates 2..14
    valid[1, [1, 3, 9]] = True  # length 10: candidates 1, 3 (9 + 4 > 10)
    # row 2: no valid position -> all padding
    anchors, ok = sample_anchors(valid, 4, 5, torch.Generator().manual_seed(0))
    assert anchors.shape == ok.shape == (3, 5) and anchors.dtype == torch.long
    row0 = anchors[0][ok[0]].tolist()
    assert ok[0].all() and len(set(row0)) == 5 and row0 == sorted(row0) and all(2 <= a <= 14 for a in row0)
    assert ok[1].tolist() == [True, True, False, False, False] and anchors[1].tolist() == [1, 3, 0, 0, 0]
    assert not ok[2].any() and anchors[2].tolist() == [0] * 5
    again, ok2 = sample_anchors(valid, 4, 5, torch.Generator().manual_seed(0))
    assert torch.equal(again, anchors) and torch.equal(ok2, ok)
    other = {tuple(sample_anchors(valid, 4, 5, torch.Generator().manual_seed(s))[0][0].tolist()) for s in range(1, 6)}
    assert len(other - {tuple(anchors[0].tolist())}) >= 4  # another seed -> another draw
    # every candidate gets drawn eventually, never a non-candidate
    seen: set[int] = set()
    for s in range(40):
        a, m = sample_anchors(valid[:1], 4, 3, torch.Generator().manual_seed(s))
        seen |= set(a[m].tolist())
    assert seen == set(range(2, 15))
    # nb shrinks to the largest candidate count: rows 1 and 2 alone have at most 2 candidates
    short, short_ok = sample_anchors(valid[1:], 4, 5, torch.Generator().manual_seed(0))
    assert short.tolist() == [[1, 3], [0, 0]] and short_ok.tolist() == [[True, True], [False, False]]
    none, none_ok = sample_anchors(valid[2:], 4, 5)  # no candidate at all: one padding block
    assert none.tolist() == [[0]] and none_ok.tolist() == [[False]]
    with pytest.raises(ValueError, match="num_anchors: got 0"):
        sample_anchors(valid, 4, 0)


# ----------------------------------------------------------------------------- the backbone

SPEC = tiny_spec(vocab=32, hidden=16, layers=8, heads=4, kv_heads=2)
BS = 3


def _model(num_layers: int = 2, seed: int = 0) -> DFlashDraft:
    torch.manual_seed(seed)
    head = TargetHead(SPEC, torch.randn(32, 16), torch.randn(32, 16), torch.ones(16))
    cfg = DFlashConfig(num_layers=num_layers, block_size=BS, target_layer_ids=(1, 5), num_target_features=2,
                       mask_token_id=31, attn_backend="sdpa")
    model = DFlashDraft(cfg, head)
    with torch.no_grad():  # non-trivial norms so the reference checks every weight
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
    return model


def _inputs(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    features = torch.randn(2, 9, 32, generator=g)
    anchors = torch.tensor([[1, 4, 6], [0, 5, 0]])
    valid = torch.tensor([[True, True, True], [True, True, False]])
    ids = torch.randint(0, 31, (2, 9), generator=g)
    return features, block_input_ids(ids, anchors, BS, 31), anchors, valid


def test_parameter_names_are_the_engine_tensor_names() -> None:
    model = _model(num_layers=2)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    expected = {"fc.weight": (16, 32), "hidden_norm.weight": (16,), "norm.weight": (16,)}
    for i in range(2):
        p = f"layers.{i}."
        expected |= {p + "input_layernorm.weight": (16,), p + "post_attention_layernorm.weight": (16,),
                     p + "self_attn.q_proj.weight": (16, 16), p + "self_attn.k_proj.weight": (8, 16),
                     p + "self_attn.v_proj.weight": (8, 16), p + "self_attn.o_proj.weight": (16, 16),
                     p + "self_attn.q_norm.weight": (4,), p + "self_attn.k_norm.weight": (4,),
                     p + "mlp.gate_proj.weight": (32, 16), p + "mlp.up_proj.weight": (32, 16),
                     p + "mlp.down_proj.weight": (16, 32)}
    assert shapes == expected
    assert {n for n, _ in model.named_buffers()} >= {"target_embed_tokens", "target_lm_head"}
    assert not any(b.requires_grad for b in model.buffers())


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return w * x / torch.sqrt((x * x).mean(-1, keepdim=True) + eps)


def _rope(x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """x [T, heads, D], pos [T] -> rotate-half RoPE, theta 10000."""
    d = x.shape[-1]
    inv = torch.tensor([10000.0 ** (-2 * i / d) for i in range(d // 2)])
    ang = pos.float()[:, None] * inv  # [T, D/2]
    cos, sin = torch.cat([ang.cos(), ang.cos()], -1)[:, None], torch.cat([ang.sin(), ang.sin()], -1)[:, None]
    rot = torch.cat([-x[..., d // 2:], x[..., : d // 2]], -1)
    return x * cos + rot * sin


def _reference_block(model: DFlashDraft, feat: torch.Tensor, tokens: torch.Tensor, a: int) -> torch.Tensor:
    """One block, plainly: context = positions 0..a-1 only, explicit softmax attention."""
    ctx = _rms(feat[:a] @ model.fc.weight.T, model.hidden_norm.weight)  # [a, H]
    x = model.target_embed_tokens[tokens]  # [B, H]
    ctx_pos, blk_pos = torch.arange(a), torch.arange(a, a + len(tokens))
    for layer in model.layers:
        assert isinstance(layer, DFlashDecoderLayer)
        at = layer.self_attn
        y = _rms(x, layer.input_layernorm.weight)
        kv_in = torch.cat([ctx, y])
        q = _rms((y @ at.q_proj.weight.T).view(len(tokens), 4, 4), at.q_norm.weight)
        k = _rms((kv_in @ at.k_proj.weight.T).view(len(kv_in), 2, 4), at.k_norm.weight)
        v = (kv_in @ at.v_proj.weight.T).view(len(kv_in), 2, 4)
        q, k = _rope(q, blk_pos), _rope(k, torch.cat([ctx_pos, blk_pos]))
        heads = []
        for hq in range(4):
            hk = hq // 2  # grouped-query: 2 query heads per kv head
            scores = q[:, hq] @ k[:, hk].T / math.sqrt(4)  # [B, a + B], every key visible
            p = torch.exp(scores - scores.max(-1, keepdim=True).values)
            heads.append((p / p.sum(-1, keepdim=True)) @ v[:, hk])
        x = x + torch.cat(heads, -1) @ at.o_proj.weight.T
        y = _rms(x, layer.post_attention_layernorm.weight)
        mlp = layer.mlp
        x = x + (torch.nn.functional.silu(y @ mlp.gate_proj.weight.T) * (y @ mlp.up_proj.weight.T)) @ mlp.down_proj.weight.T
    return _rms(x, model.norm.weight) @ model.target_lm_head.T  # [B, V]


def test_backbone_matches_per_block_reference() -> None:
    model = _model()
    features, block_ids, anchors, valid = _inputs()
    with torch.no_grad():
        logits = model.logits(model(features, block_ids, anchors, valid))
        assert logits.shape == (2, 3, BS, 32)
        for b in range(2):
            for j in range(3):
                if valid[b, j]:
                    ref = _reference_block(model, features[b], block_ids[b, j], int(anchors[b, j]))
                    torch.testing.assert_close(logits[b, j], ref, atol=1e-5, rtol=1e-5)
        assert torch.isfinite(logits).all()  # the padding block too


def test_queries_see_only_the_masked_keys() -> None:
    model = _model()
    features, block_ids, anchors, valid = _inputs()
    with torch.no_grad():
        base = model.logits(model(features, block_ids, anchors, valid))
        # row 0: anchors (1, 4, 6). Changing context position 4 must leave blocks 0 (a=1) and 1
        # (a=4) unchanged and change block 2 (a=6).
        f2 = features.clone()
        f2[0, 4] += 1.0
        out = model.logits(model(f2, block_ids, anchors, valid))
        torch.testing.assert_close(out[0, :2], base[0, :2], atol=0, rtol=0)
        assert (out[0, 2] - base[0, 2]).abs().amax(-1).min() > 1e-4  # every slot of block 2 moves
        torch.testing.assert_close(out[1], base[1], atol=0, rtol=0)  # other sequence untouched
        # changing context position 0 changes every valid block of row 0
        f3 = features.clone()
        f3[0, 0] += 1.0
        out = model.logits(model(f3, block_ids, anchors, valid))
        assert all((out[0, j] - base[0, j]).abs().amax(-1).min() > 1e-4 for j in range(3))
        # a token inside block 1 (its last slot): all of block 1 changes (non-causal), other blocks do not
        ids2 = block_ids.clone()
        ids2[0, 1, BS - 1] = 7
        out = model.logits(model(features, ids2, anchors, valid))
        assert (out[0, 1] - base[0, 1]).abs().amax(-1).min() > 1e-4
        torch.testing.assert_close(out[0, [0, 2]], base[0, [0, 2]], atol=0, rtol=0)


def test_gradients_reach_the_draft_only() -> None:
    model = _model()
    features, block_ids, anchors, valid = _inputs()
    model.logits(model(features, block_ids, anchors, valid)).sum().backward()
    assert all(p.grad is not None for p in model.parameters())
    assert model.target_lm_head.grad is None and model.target_embed_tokens.grad is None
