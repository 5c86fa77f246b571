"""Transformers-free tiny targets for drafter tests.

- `TinyTarget`: a random Qwen/Llama-like decoder built from drafters.common.layers, returning
  HF-style outputs (`.logits` [B, T, V], `.hidden_states`: L + 1 tensors, entry 0 = embeddings,
  entry L = post-final-norm, as HF does).
- `BigramTarget`: next-token distribution depends on the last token only (exact probabilities
  are known in closed form: softmax(table[prev])), for statistical losslessness tests.
- `damaged_copy`: a copy of an export directory with its config.json / tensors edited (export
  checks must refuse it).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from drafters.common.layers import DecoderLayer, RMSNorm
from drafters.common.masks import ttt_attention_mask
from drafters.common.target import TargetHead, TargetSpec


@dataclass
class TargetOutput:
    logits: Tensor
    hidden_states: tuple[Tensor, ...] | None


def tiny_spec(vocab: int = 32, hidden: int = 16, layers: int = 4, heads: int = 4, kv_heads: int = 2) -> TargetSpec:
    return TargetSpec(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, head_dim=hidden // heads, intermediate_size=2 * hidden,
                      rope_theta=10000.0, rms_norm_eps=1e-6, max_position_embeddings=256, model_type="qwen3",
                      tie_word_embeddings=False)


class TinyTarget(nn.Module):
    def __init__(self, spec: TargetSpec, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.spec = spec
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(spec.hidden_size, spec.intermediate_size, spec.num_attention_heads,
                         spec.num_key_value_heads, spec.head_dim, spec.rope_theta, spec.rms_norm_eps)
            for _ in range(spec.num_hidden_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.lm_head = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        with torch.no_grad():
            self.lm_head.weight.mul_(8.0)  # peaked distributions: greedy runs are not all ties

    def forward(self, input_ids: Tensor, output_hidden_states: bool = False) -> TargetOutput:
        b, t = input_ids.shape
        pos = torch.arange(t).expand(b, t)
        mask = ttt_attention_mask(torch.ones(b, t, dtype=torch.bool), 0)
        h = self.embed_tokens(input_ids)
        states = [h]
        for i, layer in enumerate(self.layers):
            h, _ = layer(h, pos, mask, None, "sdpa")
            states.append(self.norm(h) if i == len(self.layers) - 1 else h)
        logits = self.lm_head(self.norm(h))
        return TargetOutput(logits, tuple(states) if output_hidden_states else None)

    def head(self) -> TargetHead:
        return TargetHead(self.spec, self.embed_tokens.weight.detach().clone(), self.lm_head.weight.detach().clone(),
                          self.norm.weight.detach().clone())

    @torch.no_grad()
    def features(self, input_ids: Tensor, aux_layer_ids: tuple[int, ...], loss_mask: Tensor) -> dict[str, Tensor]:
        """One feature-store sample for a sequence input_ids [T]."""
        out = self(input_ids[None], output_hidden_states=True)
        assert out.hidden_states is not None
        hs = [h[0] for h in out.hidden_states]
        return {"input_ids": input_ids.long(), "loss_mask": loss_mask.to(torch.uint8),
                "aux_hidden": torch.cat([hs[i] for i in aux_layer_ids], -1), "last_hidden": hs[-1]}


class BigramTarget(nn.Module):
    """logits[t] = table[input_ids[t]]; hidden_states = (one-hot ids, one-hot ids)."""

    def __init__(self, table: Tensor):
        super().__init__()
        self.table = table

    def forward(self, input_ids: Tensor, output_hidden_states: bool = False) -> TargetOutput:
        h = torch.nn.functional.one_hot(input_ids, self.table.shape[0]).float()
        return TargetOutput(self.table[input_ids], (h, h) if output_hidden_states else None)


def damaged_copy(src: Path, dst: Path, edit_config: Callable[[dict[str, Any]], Any] | None = None,
                 edit_tensors: Callable[[dict[str, Tensor]], Any] | None = None) -> Path:
    """`src` copied to `dst`, then `edit_config(config dict)` / `edit_tensors(name -> tensor)` applied
    in place and written back."""
    shutil.copytree(src, dst)
    if edit_config is not None:
        cfg = json.loads((dst / "config.json").read_text())
        edit_config(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    if edit_tensors is not None:
        tensors = load_file(str(dst / "model.safetensors"))
        edit_tensors(tensors)
        save_file(tensors, str(dst / "model.safetensors"))
    return dst
