"""Importing every drafters module (and building/using EAGLE-3) loads no engine, no transformers, no CUDA."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
HEAVY = ["transformers", "vllm", "verl", "ray", "sglang", "torch_npu"]

PROBE = f"""
import importlib, json, pkgutil, sys
import drafters
names = [m.name for m in pkgutil.walk_packages(drafters.__path__, "drafters.")]
for name in names:
    importlib.import_module(name)
import torch
from drafters import get_family
from drafters.common.target import TargetHead, TargetSpec
spec = TargetSpec(vocab_size=16, hidden_size=8, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1,
                  head_dim=4, intermediate_size=16, rope_theta=1e4, rms_norm_eps=1e-6, max_position_embeddings=64,
                  model_type="qwen3", tie_word_embeddings=False)
family = get_family("eagle3")
model = family.build(family.config_cls(ttt_steps=2, aux_layer_ids=(1, 2, 3)), TargetHead(spec, torch.randn(16, 8), torch.randn(16, 8), torch.ones(8)))
sample = dict(input_ids=torch.arange(5), loss_mask=torch.ones(5, dtype=torch.uint8),
              aux_hidden=torch.randn(5, 24), last_hidden=torch.randn(5, 8))
family.objective(model, family.collate([sample])).loss().backward()
heavy = sorted(m for m in sys.modules if m.split(".")[0] in {HEAVY!r})
print(json.dumps({{"modules": len(names), "heavy": heavy, "cuda": torch.cuda.is_initialized()}}))
"""


def test_import_drafters_loads_no_engine_and_no_cuda() -> None:
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["modules"] >= 20
    assert report["heavy"] == [] and report["cuda"] is False
