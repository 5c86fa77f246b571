"""Llama/Qwen-style building blocks shared by the drafter families.

Parameter names follow HF Llama (`q_proj`, `gate_proj`, `input_layernorm`, ...) so engine export
is a name map. Shapes: hidden [B, T, H]; per-head tensors [B, heads, T, head_dim]."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from drafters.common.attention import attend
from drafters.common.masks import AttentionMask

KV = tuple[Tensor, Tensor]  # keys, values: [B, Hkv, Tk, D] each


class RMSNorm(nn.Module):
    """y = weight * x / sqrt(mean(x^2) + eps), normalised in float32 (HF LlamaRMSNorm)."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(x.dtype)


class RotaryEmbedding(nn.Module):
    """Default (unscaled) RoPE: inv_freq_i = theta^(-2i/D); rotate-half layout as in HF Llama/Qwen."""

    inv_freq: Tensor

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"head_dim: got {head_dim}, expected an even number for RoPE")
        inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
        self.register_buffer("inv_freq", inv, persistent=False)

    def forward(self, position_ids: Tensor) -> tuple[Tensor, Tensor]:
        """position_ids [B, T] -> (cos, sin) float32 [B, T, D]."""
        freqs = position_ids.float()[..., None] * self.inv_freq.float()  # [B, T, D/2]
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos(), emb.sin()


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x [B, heads, T, D], cos/sin [B, T, D] -> rotated x (same dtype)."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    c, s = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)
    return x * c + rotated * s


class GatedMLP(nn.Module):
    """down_proj(silu(gate_proj(x)) * up_proj(x)), no biases."""

    def __init__(self, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class SelfAttention(nn.Module):
    """q/k/v/o projections (no bias) with RoPE; `input_size` may differ from `hidden_size`
    (EAGLE-3's first layer reads 2H). Keys/values of earlier calls can be prepended (`kv_before`)."""

    def __init__(self, input_size: int, hidden_size: int, num_heads: int, num_kv_heads: int,
                 head_dim: int, rope_theta: float):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads={num_heads} not a multiple of num_key_value_heads={num_kv_heads}")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.q_proj = nn.Linear(input_size, num_heads * head_dim, bias=False)
        self.k_proj = nn.Linear(input_size, num_kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(input_size, num_kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden_size, bias=False)
        self.rotary = RotaryEmbedding(head_dim, rope_theta)

    def forward(self, x: Tensor, position_ids: Tensor, mask: AttentionMask | None,
                kv_before: KV | None = None, backend: str = "auto", q_offset: int = 0) -> tuple[Tensor, KV]:
        """x [B, T, in], position_ids [B, T] -> (out [B, T, H], this call's (k, v) [B, Hkv, T, D]), over keys
        cat(kv_before, this call's); q_offset > 0: x holds rows q_offset.. and the k/v are front-padded to T."""
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        # a copy (same strides), not a view of v_proj's output: v is returned, and FSDP2 warns that a view
        # returned by a sharded module (a decoder layer) loses its pre-backward hook to any in-place op
        v = self.v_proj(x).view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2).clone()
        cos, sin = self.rotary(position_ids)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if q_offset:
            k, v = F.pad(k, (0, 0, q_offset, 0)), F.pad(v, (0, 0, q_offset, 0))
        k_all, v_all = (k, v) if kv_before is None else (
            torch.cat([kv_before[0], k], dim=2), torch.cat([kv_before[1], v], dim=2))
        out = attend(q, k_all, v_all, mask, backend)  # [B, Hq, T, D]
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1)), (k, v)


class DecoderLayer(nn.Module):
    """Plain pre-norm Llama layer: h + attn(input_layernorm(h)), then + mlp(post_attention_layernorm)."""

    def __init__(self, hidden_size: int, intermediate_size: int, num_heads: int, num_kv_heads: int,
                 head_dim: int, rope_theta: float, eps: float):
        super().__init__()
        self.input_layernorm = RMSNorm(hidden_size, eps)
        self.self_attn = SelfAttention(hidden_size, hidden_size, num_heads, num_kv_heads, head_dim, rope_theta)
        self.post_attention_layernorm = RMSNorm(hidden_size, eps)
        self.mlp = GatedMLP(hidden_size, intermediate_size)

    def forward(self, h: Tensor, position_ids: Tensor, mask: AttentionMask | None,
                kv_before: KV | None = None, backend: str = "auto", q_offset: int = 0) -> tuple[Tensor, KV]:
        attn, kv = self.self_attn(self.input_layernorm(h), position_ids, mask, kv_before, backend, q_offset)
        h = h + attn
        return h + self.mlp(self.post_attention_layernorm(h)), kv
