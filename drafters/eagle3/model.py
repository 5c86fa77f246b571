"""EAGLE-3 draft model (docs/design/algorithms.md section 3; vLLM `llama_eagle3.py`, SafeAILab `cnets.py`);
the frozen target head for training targets is the buffer `target_lm_head`. One layer, h features, e embeddings:
    x = cat[input_layernorm(e), hidden_norm(h)]            # [B, T, 2H]
    h' = h + self_attn(x); out = h' + mlp(post_attention_layernorm(h'))   # pre-norm, the next step's h
    logits = lm_head(norm(out))                            # [B, T, Vd]; the first step's h is fc(aux)"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Generic, TypeVar

import torch
from torch import Tensor, nn

from drafters.common.layers import KV, DecoderLayer, GatedMLP, RMSNorm, SelfAttention
from drafters.common.masks import AttentionMask, ttt_attention_mask, ttt_position_ids
from drafters.common.target import TargetHead, TargetSpec
from drafters.common.vocab import DraftVocab
from drafters.eagle3.config import Eagle3Architecture, Eagle3Config

ConfigT = TypeVar("ConfigT", bound=Eagle3Architecture)


class Eagle3MidLayer(nn.Module):
    """The fused first layer: attention over cat[input_layernorm(embeds), hidden_norm(h)] (2H)."""

    def __init__(self, spec: TargetSpec, norm_before_residual: bool):
        super().__init__()
        h, eps = spec.hidden_size, spec.rms_norm_eps
        self.norm_before_residual = norm_before_residual
        self.hidden_norm = RMSNorm(h, eps)
        self.input_layernorm = RMSNorm(h, eps)
        self.self_attn = SelfAttention(2 * h, h, spec.num_attention_heads, spec.num_key_value_heads,
                                       spec.head_dim, spec.rope_theta)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.mlp = GatedMLP(h, spec.intermediate_size)

    def forward(self, embeds: Tensor, h: Tensor, position_ids: Tensor, mask: AttentionMask | None,
                kv_before: KV | None, backend: str, q_offset: int = 0) -> tuple[Tensor, KV]:
        normed = self.hidden_norm(h)
        residual = normed if self.norm_before_residual else h
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        attn, kv = self.self_attn(x, position_ids, mask, kv_before, backend, q_offset)
        h = residual + attn
        return h + self.mlp(self.post_attention_layernorm(h)), kv


@dataclass
class Eagle3DraftState:
    """Inference state after `prefill` / `step` (all rows share one length): kv[l] per layer the
    (keys, values) so far; hidden [B, H] pre-norm output of the last row; logits [B, Vd]; next_position [B]."""

    kv: list[KV]
    hidden: Tensor
    logits: Tensor
    next_position: Tensor


def _cat_kv(before: KV | None, new: KV) -> KV:
    return new if before is None else (torch.cat([before[0], new[0]], 2), torch.cat([before[1], new[1]], 2))


class Eagle3Backbone(nn.Module, Generic[ConfigT]):
    """The EAGLE-3 draft's modules and layer stack, generic in the config (EAGLE-3's or P-EAGLE's)."""

    d2t: Tensor
    t2d: Tensor
    target_lm_head: Tensor

    def __init__(self, cfg: ConfigT, target: TargetHead, vocab: DraftVocab):
        super().__init__()
        spec = target.spec
        if cfg.aux_layer_ids is None or cfg.draft_vocab_size is None:
            cfg = cfg.resolve(spec)
        assert cfg.aux_layer_ids is not None
        if vocab.draft_size != cfg.draft_vocab_size or vocab.vocab_size != spec.vocab_size:
            raise ValueError(f"vocab: maps {vocab.draft_size} -> {vocab.vocab_size}, config expects "
                             f"{cfg.draft_vocab_size} -> {spec.vocab_size}")
        self.cfg: ConfigT = cfg
        self.spec = spec
        h = spec.hidden_size
        self.fc = nn.Linear(len(cfg.aux_layer_ids) * h, h, bias=False)
        self.midlayer = Eagle3MidLayer(spec, cfg.norm_before_residual)
        self.layers = nn.ModuleDict({
            str(i): DecoderLayer(h, spec.intermediate_size, spec.num_attention_heads, spec.num_key_value_heads,
                                 spec.head_dim, spec.rope_theta, spec.rms_norm_eps)
            for i in range(1, cfg.num_layers)})
        self.norm = RMSNorm(h, spec.rms_norm_eps)
        self.lm_head = nn.Linear(h, vocab.draft_size, bias=False)
        self.embed_tokens = nn.Embedding(spec.vocab_size, h)
        with torch.no_grad():
            self.embed_tokens.weight.copy_(target.embed_tokens)
            if cfg.lm_head_init == "target":
                self.lm_head.weight.copy_(target.lm_head[vocab.t2d])
        self.embed_tokens.weight.requires_grad_(False)
        self.register_buffer("d2t", vocab.d2t.clone())
        self.register_buffer("t2d", vocab.t2d.clone())
        self.register_buffer("target_lm_head", target.lm_head.detach().clone(), persistent=False)

    @property
    def draft_vocab(self) -> DraftVocab:
        return DraftVocab(self.d2t, self.t2d)

    def target_logits(self, last_hidden: Tensor) -> Tensor:
        """[..., H] post-final-norm target hidden -> [..., V] target logits (no grad)."""
        with torch.no_grad():
            return last_hidden.to(self.target_lm_head.dtype) @ self.target_lm_head.T

    def _layers(self, embeds: Tensor, h: Tensor, pos: Tensor, mask: AttentionMask | None,
                kv_before: list[KV] | None, q_offset: int = 0) -> tuple[Tensor, list[KV]]:
        backend = self.cfg.attn_backend
        h, kv0 = self.midlayer(embeds, h, pos, mask, None if kv_before is None else kv_before[0], backend, q_offset)
        new_kv = [kv0]
        for i, layer in enumerate(self.layers.values(), start=1):
            h, kv = layer(h, pos, mask, None if kv_before is None else kv_before[i], backend, q_offset)
            new_kv.append(kv)
        return h, new_kv



class Eagle3Model(Eagle3Backbone[Eagle3Config]):
    """EAGLE-3: the backbone with the training-time-test unroll and chain drafting."""

    def unroll(self, step_input_ids: Tensor, aux_hidden: Tensor, attention_mask: Tensor,
               position_ids: Tensor | None = None, row_start: list[int] | None = None) -> list[Tensor]:
        """Training-time test unroll: step j's post-norm hidden [B, T - row_start[j], H]; rows before
        row_start[j] (non-decreasing, row_start[0] == 0) are ones no loss needs, so results are unchanged."""
        steps, b, t = step_input_ids.shape
        starts = [0] * steps if row_start is None else list(row_start)
        if len(starts) != steps or starts[0] != 0 or any(not 0 <= s < t for s in starts) or \
                any(x > y for x, y in zip(starts, starts[1:])):
            raise ValueError(f"row_start: got {starts}, expected {steps} non-decreasing values in 0..{t - 1} "
                             "starting with 0")
        pos0 = position_ids if position_ids is not None else torch.arange(t, device=aux_hidden.device).expand(b, t)
        h = self.fc(aux_hidden.to(self.fc.weight.dtype))
        cache: list[KV] | None = None
        normed: list[Tensor] = []
        for j, lo in enumerate(starts):
            h = h[:, lo - starts[j - 1]:] if j else h
            embeds = self.embed_tokens(step_input_ids[j][:, lo:])
            h, new_kv = self._layers(embeds, h, ttt_position_ids(pos0, j)[:, lo:],
                                     ttt_attention_mask(attention_mask, j, lo), cache, lo)
            cache = new_kv if cache is None else [_cat_kv(c, n) for c, n in zip(cache, new_kv)]
            normed.append(self.norm(h))
        return normed

    def forward(self, step_input_ids: Tensor, aux_hidden: Tensor, attention_mask: Tensor,
                position_ids: Tensor | None = None) -> list[Tensor]:
        """Training-time test unroll -> S draft logits [B, T, Vd]: step_input_ids int64 [S, B, T] (step j
        row t = x_{t+1+j}), aux_hidden [B, T, k*H_t] (row t = f_t), attention_mask bool [B, T]."""
        return [self.lm_head(x) for x in self.unroll(step_input_ids, aux_hidden, attention_mask, position_ids)]

    @torch.no_grad()
    def prefill(self, input_ids: Tensor, aux_hidden: Tensor) -> Eagle3DraftState:
        """First drafting step over a prefix (vLLM's first EAGLE-3 forward): input_ids [B, T] (row t =
        x_{t+1}), aux_hidden [B, T, k*H_t] (row t = f_t); the last row predicts the next token."""
        b, t = input_ids.shape
        pos = torch.arange(t, device=input_ids.device).expand(b, t)
        valid = torch.ones(b, t, dtype=torch.bool, device=input_ids.device)
        h = self.fc(aux_hidden.to(self.fc.weight.dtype))
        h, kv = self._layers(self.embed_tokens(input_ids), h, pos, ttt_attention_mask(valid, 0), None)
        return Eagle3DraftState(kv, h[:, -1], self.lm_head(self.norm(h[:, -1])), pos[:, -1] + 1)

    @torch.no_grad()
    def step(self, state: Eagle3DraftState, token_ids: Tensor) -> Eagle3DraftState:
        """Next drafting step: token_ids [B] with the previous pre-norm hidden (no fc); the query sees
        every cached key (the last row of the TTT mask)."""
        embeds = self.embed_tokens(token_ids)[:, None]
        pos = state.next_position[:, None]
        h, new_kv = self._layers(embeds, state.hidden[:, None], pos, None, state.kv)
        kv = [_cat_kv(c, n) for c, n in zip(state.kv, new_kv)]
        return Eagle3DraftState(kv, h[:, -1], self.lm_head(self.norm(h[:, -1])), state.next_position + 1)
