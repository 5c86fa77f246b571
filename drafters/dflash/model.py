"""DFlash draft backbone (docs/design/algorithms.md section 4; z-lab `dflash/model.py`, vLLM `qwen3_dflash.py`).
No embedding or head of its own (the frozen target's are non-persistent buffers). n context positions,
nb blocks of B rows (common/blocks.py):
    H_ctx = hidden_norm(fc(features))                          # [batch, n, H], fixed for all layers
    x = target_embed_tokens[anchor, MASK x (B - 1)]            # [batch, nb*B, H]
    every layer: queries from the rows, keys/values from [H_ctx ; rows] under the block mask
    logits = target_lm_head(norm(x))                           # [batch, nb, B, V]"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from drafters.common.attention import attend
from drafters.common.blocks import block_attention_mask, block_position_ids, context_position_ids
from drafters.common.chunked_head import head_weight
from drafters.common.layers import GatedMLP, RMSNorm, RotaryEmbedding, apply_rotary
from drafters.common.masks import AttentionMask
from drafters.common.target import TargetHead, TargetSpec
from drafters.dflash.config import DFlashConfig


class DFlashAttention(nn.Module):
    """Qwen3 attention (per-head q_norm / k_norm, no bias) whose queries come from the block rows
    and whose keys/values come from [context ; block rows]."""

    def __init__(self, spec: TargetSpec):
        super().__init__()
        h, heads, kv_heads, d = spec.hidden_size, spec.num_attention_heads, spec.num_key_value_heads, spec.head_dim
        if heads % kv_heads:
            raise ValueError(f"num_attention_heads={heads} not a multiple of num_key_value_heads={kv_heads}")
        self.num_heads, self.num_kv_heads, self.head_dim = heads, kv_heads, d
        self.q_proj = nn.Linear(h, heads * d, bias=False)
        self.k_proj = nn.Linear(h, kv_heads * d, bias=False)
        self.v_proj = nn.Linear(h, kv_heads * d, bias=False)
        self.o_proj = nn.Linear(heads * d, h, bias=False)
        self.q_norm = RMSNorm(d, spec.rms_norm_eps)
        self.k_norm = RMSNorm(d, spec.rms_norm_eps)
        self.rotary = RotaryEmbedding(d, spec.rope_theta)

    def forward(self, x: Tensor, ctx: Tensor, block_pos: Tensor, ctx_pos: Tensor, mask: AttentionMask,
                backend: str) -> Tensor:
        """x [batch, nb*B, H] (normed block rows), ctx [batch, n, H] -> [batch, nb*B, H]."""
        b, t, _ = x.shape
        kv_in = torch.cat([ctx, x], dim=1)  # [batch, n + nb*B, H]
        s = kv_in.shape[1]
        q = self.q_norm(self.q_proj(x).view(b, t, self.num_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(kv_in).view(b, s, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(kv_in).view(b, s, self.num_kv_heads, self.head_dim).transpose(1, 2)
        cos_q, sin_q = self.rotary(block_pos)  # [batch, nb*B, D]
        cos_k, sin_k = self.rotary(torch.cat([ctx_pos, block_pos], dim=1))  # [batch, n + nb*B, D]
        q, k = apply_rotary(q, cos_q, sin_q), apply_rotary(k, cos_k, sin_k)
        out = attend(q, k, v, mask, backend)  # [batch, heads, nb*B, D]
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class DFlashDecoderLayer(nn.Module):
    """Pre-norm Qwen3 layer over the block rows; the context enters as extra keys/values only."""

    def __init__(self, spec: TargetSpec):
        super().__init__()
        h, eps = spec.hidden_size, spec.rms_norm_eps
        self.input_layernorm = RMSNorm(h, eps)
        self.self_attn = DFlashAttention(spec)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.mlp = GatedMLP(h, spec.intermediate_size)

    def forward(self, x: Tensor, ctx: Tensor, block_pos: Tensor, ctx_pos: Tensor, mask: AttentionMask,
                backend: str) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), ctx, block_pos, ctx_pos, mask, backend)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDraft(nn.Module):
    """The DFlash backbone (module docstring). `cfg` is resolved against `target.spec` here."""

    target_embed_tokens: Tensor
    target_lm_head: Tensor

    def __init__(self, cfg: DFlashConfig, target: TargetHead):
        super().__init__()
        spec = target.spec
        cfg = cfg.resolve(spec)
        assert cfg.target_layer_ids is not None and cfg.mask_token_id is not None
        self.cfg, self.spec = cfg, spec
        h = spec.hidden_size
        self.fc = nn.Linear(cfg.num_target_features * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, spec.rms_norm_eps)
        self.layers = nn.ModuleList(DFlashDecoderLayer(spec) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(h, spec.rms_norm_eps)
        self.register_buffer("target_embed_tokens", target.embed_tokens.detach().clone(), persistent=False)
        self.register_buffer("target_lm_head", target.lm_head.detach().clone(), persistent=False)

    def context(self, features: Tensor) -> Tensor:
        """[batch, n, m*H] concatenated target features -> H_ctx [batch, n, H]."""
        return self.hidden_norm(self.fc(features.to(self.fc.weight.dtype)))

    def forward(self, features: Tensor, block_ids: Tensor, anchors: Tensor, anchor_valid: Tensor) -> Tensor:
        """Post-norm block hidden states [batch, nb, B, H] (`logits` maps them through the frozen head).

        features: [batch, n, m*H] (row p = position p); block_ids: int64 [batch, nb, B] (normally
        `blocks.block_input_ids`); anchors: int64 [batch, nb]; anchor_valid: bool [batch, nb]."""
        batch, nb, bs = block_ids.shape
        if not 2 <= bs <= self.cfg.block_size:  # training: block_size rows; drafting K < B - 1: K + 1 rows
            raise ValueError(f"block_ids: blocks of {bs} rows, expected 2..block_size={self.cfg.block_size}")
        if tuple(anchors.shape) != (batch, nb):
            raise ValueError(f"anchors: got {tuple(anchors.shape)}, expected {(batch, nb)}")
        n = features.shape[1]
        ctx = self.context(features)  # [batch, n, H]
        x = self.target_embed_tokens[block_ids.flatten(1)].to(ctx.dtype)  # [batch, nb*B, H]
        block_pos = block_position_ids(anchors, bs)  # [batch, nb*B]
        ctx_pos = context_position_ids(batch, n, features.device)  # [batch, n]
        mask = block_attention_mask(anchors, anchor_valid, n, bs)  # nb*B queries, n + nb*B keys
        for layer in self.layers:
            x = layer(x, ctx, block_pos, ctx_pos, mask, self.cfg.attn_backend)
        # the norm (per row) after the reshape: the forward returns the norm's own output, not a view of it
        return self.norm(x.view(batch, nb, bs, -1))  # [batch, nb, B, H]

    def block_hidden(self, features: Tensor, block_ids: Tensor, anchors: Tensor, anchor_valid: Tensor) -> Tensor:
        """The backbone alone: `DFlashDraft.forward` whatever a subclass's forward adds (DSpark and
        Domino heads; the proposers call it step by step)."""
        return DFlashDraft.forward(self, features, block_ids, anchors, anchor_valid)

    def logits(self, hidden: Tensor, head: Tensor | None = None) -> Tensor:
        """[..., H] post-norm draft hidden -> [..., V] logits through the frozen target lm_head; `head`:
        that weight already cast (`chunked_head.head_weight`), or None to cast it here."""
        return hidden @ (head_weight(self.target_lm_head, hidden) if head is None else head).T
