"""EAGLE-1 draft model (docs/design/algorithms.md section 1; vLLM and SGLang `llama_eagle.py`): no input norm,
final norm or head of its own (the frozen target head is the buffer `target_lm_head`). Row t:
    x = fc(cat[embed(x_{t+1}), f_t])                 # [.., H]; EMBEDDING FIRST (vLLM's order)
    f^_{t+1} = h + mlp(post_attention_layernorm(h)), h = x + self_attn(x)
    draft logits = target_lm_head(f^_{t+1})           # [.., V]; f^ is also fed back at the next step"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from drafters.common.layers import KV, GatedMLP, RMSNorm, SelfAttention
from drafters.common.masks import AttentionMask, ttt_attention_mask
from drafters.common.target import TargetHead, TargetSpec
from drafters.eagle1.config import Eagle1Config


class Eagle1DecoderLayer(nn.Module):
    """Llama decoder layer 0 as the engines build it: the input norm is Identity (vLLM) / deleted (SGLang)."""

    def __init__(self, spec: TargetSpec):
        super().__init__()
        h = spec.hidden_size
        self.self_attn = SelfAttention(h, h, spec.num_attention_heads, spec.num_key_value_heads,
                                       spec.head_dim, spec.rope_theta)
        self.post_attention_layernorm = RMSNorm(h, spec.rms_norm_eps)
        self.mlp = GatedMLP(h, spec.intermediate_size)

    def forward(self, x: Tensor, position_ids: Tensor, mask: AttentionMask | None, kv_before: KV | None,
                backend: str) -> tuple[Tensor, KV]:
        """x [B, T, H] -> (output [B, T, H], this call's (k, v))."""
        attn, kv = self.self_attn(x, position_ids, mask, kv_before, backend)
        h = x + attn
        return h + self.mlp(self.post_attention_layernorm(h)), kv


@dataclass
class Eagle1DraftState:
    """Inference state after `prefill` / `step`: kv [B, Hkv, Tk, D] pairs, feature [B, H] (the last
    predicted feature, fed back), logits [B, V], next_position [B]."""

    kv: KV
    feature: Tensor
    logits: Tensor
    next_position: Tensor


class Eagle1Model(nn.Module):
    target_lm_head: Tensor

    def __init__(self, cfg: Eagle1Config, target: TargetHead):
        super().__init__()
        spec = target.spec
        self.cfg, self.spec = cfg.resolve(spec), spec
        h = spec.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.layers = nn.ModuleList([Eagle1DecoderLayer(spec)])
        self.embed_tokens = nn.Embedding(spec.vocab_size, h)
        with torch.no_grad():
            self.embed_tokens.weight.copy_(target.embed_tokens)
        self.embed_tokens.weight.requires_grad_(False)
        self.register_buffer("target_lm_head", target.lm_head.detach().clone(), persistent=False)

    def head_logits(self, feature: Tensor) -> Tensor:
        """[..., H] feature -> [..., V] logits through the frozen target LM head (gradient flows to
        `feature`, never to the head)."""
        return feature.to(self.target_lm_head.dtype) @ self.target_lm_head.T

    def _draft(self, input_ids: Tensor, features: Tensor, position_ids: Tensor, mask: AttentionMask | None,
               kv_before: KV | None) -> tuple[Tensor, KV]:
        embeds = self.embed_tokens(input_ids)  # [B, T, H]
        x = self.fc(torch.cat([embeds, features.to(embeds.dtype)], dim=-1))  # [B, T, 2H] -> [B, T, H]
        return self.layers[0](x, position_ids, mask, kv_before, self.cfg.attn_backend)

    def forward(self, input_ids: Tensor, features: Tensor, attention_mask: Tensor,
                position_ids: Tensor | None = None) -> Tensor:
        """Teacher-forced pass: input_ids [B, T] (row t = x_{t+1}), features [B, T, H] (row t = f_t),
        attention_mask bool [B, T] -> predicted features [B, T, H] (row t estimates f_{t+1})."""
        b, t = input_ids.shape
        pos = position_ids if position_ids is not None else torch.arange(t, device=input_ids.device).expand(b, t)
        out, _ = self._draft(input_ids, features, pos, ttt_attention_mask(attention_mask.to(torch.bool), 0), None)
        return out

    @torch.no_grad()
    def prefill(self, input_ids: Tensor, features: Tensor) -> Eagle1DraftState:
        """First drafting pass over a prefix: input_ids [B, T] (row t = x_{t+1}), features [B, T, H]
        (row t = f_t); the last row's logits predict the token after input_ids[:, -1]."""
        b, t = input_ids.shape
        pos = torch.arange(t, device=input_ids.device).expand(b, t)
        valid = torch.ones(b, t, dtype=torch.bool, device=input_ids.device)
        out, kv = self._draft(input_ids, features, pos, ttt_attention_mask(valid, 0), None)
        return Eagle1DraftState(kv, out[:, -1], self.head_logits(out[:, -1]), pos[:, -1] + 1)

    @torch.no_grad()
    def step(self, state: Eagle1DraftState, token_ids: Tensor) -> Eagle1DraftState:
        """Next drafting step: token_ids [B] (the previous draft token) paired with the previous
        step's own predicted feature, at the next position; attends to every cached key."""
        pos = state.next_position[:, None]
        out, kv = self._draft(token_ids[:, None], state.feature[:, None], pos, None, state.kv)
        kv_all = (torch.cat([state.kv[0], kv[0]], 2), torch.cat([state.kv[1], kv[1]], 2))
        return Eagle1DraftState(kv_all, out[:, -1], self.head_logits(out[:, -1]), state.next_position + 1)
