"""Tiny Qwen3 targets and EAGLE-3 drafts for the engine tests, built locally (no downloads).

- `build_target(dir)`: random 8-layer Qwen3 (hidden 64, vocab 96) + WordLevel tokenizer.
- `build_cycle_target(dir, perm)`: a "bigram" Qwen3 whose greedy continuation of token x is
  perm[x]: every layer adds nothing (o_proj = down_proj = 0), so each hidden state, including
  every aux capture, is the current token's embedding E[x]; lm_head row perm[x] is n(E[x]) (n =
  the final RMSNorm), which wins the argmax by a wide margin for random E in 64 dims.
- `oracle_draft(...)`: the EAGLE-3 draft that is exactly right at the FIRST draft step on the
  cycle target: fc copies the first aux slot (E[x_t]), the midlayer adds nothing, and lm_head
  row perm[perm[x]] is n(E[x]), so row t predicts x_{t+2} (what vLLM's first draft step asks for,
  see the engine notes). Later steps feed back the same hidden and repeat that token, so they are
  always wrong on a single-cycle permutation.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from drafters.eagle3.export import Eagle3ExportConfig, expected_shapes

VOCAB = 96
HIDDEN = 64
LAYERS = 8
AUX_IDS = (2, 4, 5)  # internal ids = (2, L//2, L-3), the EAGLE-3 default for L = 8
EOS_ID = 1

for _key, _val in {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1",
                   "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}.items():
    os.environ.setdefault(_key, _val)


def save_tokenizer(out_dir: Path, vocab_size: int = VOCAB) -> None:
    vocab = {"<pad>": 0, "<eos>": EOS_ID, **{f"t{i}": i for i in range(2, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<pad>",
                            eos_token="<eos>").save_pretrained(out_dir)


def _qwen3(seed: int) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=LAYERS,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                      tie_word_embeddings=False, pad_token_id=0, eos_token_id=EOS_ID, bos_token_id=None,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    return Qwen3ForCausalLM(cfg).eval().float()


def build_target(out_dir: Path, seed: int = 0) -> Path:
    model = _qwen3(seed)
    with torch.no_grad():  # sharper logits than the default init: fewer near-ties between engines
        model.lm_head.weight.normal_(0.0, 1.0)
    model.save_pretrained(out_dir)
    save_tokenizer(out_dir)
    return out_dir


def _unit_rms(x: torch.Tensor) -> torch.Tensor:
    return x / x.pow(2).mean(-1, keepdim=True).sqrt()


def build_cycle_target(out_dir: Path, perm: list[int], seed: int = 1) -> Path:
    model = _qwen3(seed)
    with torch.no_grad():
        emb = model.model.embed_tokens.weight
        emb.normal_(0.0, 1.0)  # no zero (padding) row: every token needs a direction
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.norm.weight.fill_(1.0)
        model.lm_head.weight[torch.tensor(perm)] = _unit_rms(emb)
    model.save_pretrained(out_dir)
    save_tokenizer(out_dir)
    return out_dir


def cycle_continuation(perm: list[int], start: int, n: int) -> list[int]:
    out, x = [], start
    for _ in range(n):
        x = perm[x]
        out.append(x)
    return out


def draft_config(draft_vocab_size: int = VOCAB) -> Eagle3ExportConfig:
    return Eagle3ExportConfig(hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                              intermediate_size=128, rms_norm_eps=1e-6, rope_theta=10000.0, vocab_size=VOCAB,
                              draft_vocab_size=draft_vocab_size, target_hidden_size=HIDDEN,
                              max_position_embeddings=512, aux_layer_ids=AUX_IDS, target_num_hidden_layers=LAYERS)


def random_draft(cfg: Eagle3ExportConfig, seed: int = 0, kept: list[int] | None = None) -> dict[str, torch.Tensor]:
    """Random weights of the right shapes; `kept` (sorted target ids) defines d2t/t2d."""
    gen = torch.Generator().manual_seed(seed)
    sd = {name: (torch.ones(shape) if name.endswith("norm.weight") else torch.randn(shape, generator=gen) * 0.2)
          for name, shape in expected_shapes(cfg).items() if name not in ("d2t", "t2d")}
    ids = torch.tensor(kept if kept is not None else range(cfg.draft_vocab_size), dtype=torch.int64)
    sd["d2t"] = ids - torch.arange(ids.numel())
    sd["t2d"] = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    sd["t2d"][ids] = True
    sd["embed_tokens.weight"] = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=gen)  # never exported
    return sd


def oracle_draft(cfg: Eagle3ExportConfig, target_dir: Path, perm: list[int]) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    emb = load_file(str(target_dir / "model.safetensors"))["model.embed_tokens.weight"]
    sd = random_draft(cfg, seed=5)
    sd["fc.weight"] = torch.cat([torch.eye(HIDDEN), torch.zeros(HIDDEN, 2 * HIDDEN)], dim=1)
    sd["midlayer.self_attn.o_proj.weight"].zero_()
    sd["midlayer.mlp.down_proj.weight"].zero_()
    two_step = torch.tensor([perm[perm[x]] for x in range(cfg.vocab_size)])
    sd["lm_head.weight"] = torch.zeros(cfg.vocab_size, HIDDEN)
    sd["lm_head.weight"][two_step] = _unit_rms(emb)
    return sd


def single_cycle(n: int, seed: int) -> list[int]:
    """A permutation of range(n) made of one n-cycle (so perm^k(x) != perm^j(x) for 0 < j < k < n)."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    perm = [0] * n
    for a, b in zip(order, order[1:] + order[:1]):
        perm[a] = b
    return perm


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_target(tmp_path_factory.mktemp("target"))


@pytest.fixture(scope="module")
def draft(target_dir: Path) -> tuple[torch.nn.Module, Eagle3ExportConfig]:
    """A random EAGLE-3 draft (draft vocab 48) for the tiny target, and its export config."""
    from drafters.common.contract import StoreStats
    from drafters.common.target import TargetHead
    from drafters.eagle3 import FAMILY, Eagle3Config

    head = TargetHead.from_pretrained(target_dir)
    counts = torch.randint(0, 1000, (VOCAB,), generator=torch.Generator().manual_seed(3))
    cfg = Eagle3Config(draft_vocab_size=48, aux_layer_ids=AUX_IDS, attn_backend="sdpa")
    torch.manual_seed(0)
    model = FAMILY.build(cfg, head, StoreStats(counts))
    return model, Eagle3ExportConfig.from_drafter(cfg, head.spec)
