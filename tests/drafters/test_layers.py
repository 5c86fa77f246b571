"""Shared layers: flex vs SDPA over one mask function, RMSNorm / RoPE vs formulas computed another way."""

from __future__ import annotations

import math
import warnings
from types import SimpleNamespace

import pytest
import torch

from drafters.common.attention import attend, resolve_backend
from drafters.common.layers import RMSNorm, RotaryEmbedding, SelfAttention, apply_rotary
from drafters.common.masks import ttt_attention_mask


def test_flex_and_sdpa_agree_on_ttt_mask_with_gqa_and_padding() -> None:
    g = torch.Generator().manual_seed(0)
    b, hq, hkv, t, d, step = 2, 4, 2, 6, 8, 2
    q = torch.randn(b, hq, t, d, generator=g)
    k = torch.randn(b, hkv, t * (step + 1), d, generator=g)
    v = torch.randn(b, hkv, t * (step + 1), d, generator=g)
    valid = torch.tensor([[1] * 6, [1, 1, 1, 1, 0, 0]], dtype=torch.bool)
    mask = ttt_attention_mask(valid, step)
    sdpa = attend(q, k, v, mask, "sdpa")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        flex = attend(q, k, v, mask, "flex")
    torch.testing.assert_close(flex, sdpa, atol=1e-5, rtol=1e-5)
    # reference computed by hand: explicit masked softmax with repeated kv heads
    kr, vr = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)
    scores = (q @ kr.transpose(-1, -2)) / math.sqrt(d)
    scores = scores.masked_fill(~mask.dense(), float("-inf"))
    torch.testing.assert_close(torch.softmax(scores, -1) @ vr, sdpa, atol=1e-5, rtol=1e-5)
    assert resolve_backend("auto", torch.device("cpu")) == "sdpa"


def test_flex_only_on_cuda_the_dense_mask_path_elsewhere() -> None:
    npu, cuda = SimpleNamespace(type="npu"), SimpleNamespace(type="cuda")  # no NPU torch here: the type is what is read
    assert resolve_backend("auto", cuda) == "flex"  # type: ignore[arg-type]
    assert resolve_backend("auto", npu) == "sdpa"  # type: ignore[arg-type]
    assert resolve_backend("sdpa", npu) == "sdpa"  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"attn_backend='flex' on device type 'npu'.*expected auto or sdpa"):
        resolve_backend("flex", npu)  # type: ignore[arg-type]


def test_rmsnorm_matches_formula() -> None:
    x = torch.randn(3, 5, 8)
    norm = RMSNorm(8, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 2.0, 8))
    ref = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-5) * torch.linspace(0.5, 2.0, 8)
    torch.testing.assert_close(norm(x), ref)


def test_rope_matches_complex_rotation() -> None:
    d, theta = 8, 500.0
    rope = RotaryEmbedding(d, theta)
    pos = torch.tensor([[0, 3, 7]])
    x = torch.randn(1, 2, 3, d)
    cos, sin = rope(pos)
    out = apply_rotary(x, cos, sin)
    # rotate-half layout pairs dim i with dim i + d/2; rotate each pair by angle pos * theta^(-2i/d)
    half = d // 2
    z = torch.complex(x[..., :half], x[..., half:])
    angles = pos[0, :, None].float() * theta ** (-torch.arange(half).float() * 2 / d)
    rotated = z * torch.polar(torch.ones_like(angles), angles)
    torch.testing.assert_close(out, torch.cat([rotated.real, rotated.imag], -1), atol=1e-5, rtol=1e-5)


def test_attention_with_kv_before_equals_one_pass() -> None:
    torch.manual_seed(0)
    attn = SelfAttention(12, 8, num_heads=4, num_kv_heads=2, head_dim=2, rope_theta=10000.0)
    x = torch.randn(1, 5, 12)
    pos = torch.arange(5)[None]
    full, _ = attn(x, pos, ttt_attention_mask(torch.ones(1, 5, dtype=torch.bool), 0), backend="sdpa")
    _, kv = attn(x[:, :4], pos[:, :4], ttt_attention_mask(torch.ones(1, 4, dtype=torch.bool), 0), backend="sdpa")
    last, _ = attn(x[:, 4:], pos[:, 4:], None, kv_before=kv, backend="sdpa")
    torch.testing.assert_close(last, full[:, 4:], atol=1e-6, rtol=1e-5)
