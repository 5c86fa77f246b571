"""Fixtures for the trainer tests: a tiny HF-format target directory and small Feature Stores.

The features follow a learnable rule so training has signal: for a sequence of random token ids,
aux_hidden[t] and last_hidden[t] are fixed random embeddings of x_t (three tables for the three
aux layers, one for the last hidden state), so the target's next-token distribution at t is a
function of x_t alone. Stores are written with the real `feature_store.StoreWriter`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from feature_store import Layout, StoreWriter, standard_schema

REPO = Path(__file__).resolve().parents[2]
VOCAB, HIDDEN, LAYERS = 64, 32, 8
LAYOUT = Layout(layer_ids=(2, 4, 5), last_hidden="post_norm")  # EAGLE-3 default for 8 layers


def write_target(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    config = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": VOCAB,
              "hidden_size": HIDDEN, "num_hidden_layers": LAYERS, "num_attention_heads": 2,
              "num_key_value_heads": 1, "head_dim": 16, "intermediate_size": 64, "rope_theta": 10000.0,
              "rms_norm_eps": 1e-6, "max_position_embeddings": 256, "tie_word_embeddings": False}
    (root / "config.json").write_text(json.dumps(config))
    g = torch.Generator().manual_seed(1234)
    save_file({"model.embed_tokens.weight": torch.randn(VOCAB, HIDDEN, generator=g) * 0.5,
               "lm_head.weight": torch.randn(VOCAB, HIDDEN, generator=g),
               "model.norm.weight": torch.ones(HIDDEN)}, str(root / "model.safetensors"))
    return root


def make_sample(g: torch.Generator, length: int, tables: torch.Tensor) -> dict[str, torch.Tensor]:
    """tables [4, V, H]: three aux tables and the last-hidden table."""
    ids = torch.randint(0, VOCAB, (length,), generator=g)
    mask = torch.zeros(length, dtype=torch.uint8)
    mask[length // 3:] = 1  # a "prompt" then a "response"
    aux = torch.cat([tables[i][ids] for i in range(3)], dim=-1)
    return {"input_ids": ids, "loss_mask": mask, "aux_hidden": aux.to(torch.bfloat16),
            "last_hidden": tables[3][ids].to(torch.bfloat16)}


def write_store(root: Path, num_samples: int, seed: int = 0, flush_samples: int = 8,
                nan_at: int | None = None, rank: int = 0, encoding: str = "raw") -> Path:
    """`num_samples` samples of 8..24 tokens; sample `nan_at` gets a NaN in aux_hidden; hidden states
    stored as `encoding` ("raw" bf16 or "fp8_e4m3")."""
    g = torch.Generator().manual_seed(seed)
    tables = torch.randn(4, VOCAB, HIDDEN, generator=torch.Generator().manual_seed(99))
    schema = standard_schema(LAYOUT, hidden_size=HIDDEN, vocab_size=VOCAB, target_model_id="tiny-test",
                             hidden_encoding=encoding)
    with StoreWriter(root, schema, rank=rank, flush_samples=flush_samples, check_values=nan_at is None) as w:
        for i in range(num_samples):
            sample = make_sample(g, int(torch.randint(8, 25, (1,), generator=g)), tables)
            if i == nan_at:
                sample["aux_hidden"][3, 5] = float("nan")
            w.add(sample, step=0)
    return root


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_target(tmp_path_factory.mktemp("target"))


@pytest.fixture(scope="session")
def tiny_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """32 samples in 4 shards (eval_fraction 0.25 holds out the last one: 24 train, 8 eval)."""
    return write_store(tmp_path_factory.mktemp("store") / "store", 32)


def overrides(target: Path, store: Path, out: Path, *extra: str) -> list[str]:
    """A small, fast EAGLE-3 run (ttt 3, sdpa) on the tiny target."""
    return [f"target.path={target}", f"data.store={store}", f"run.out_dir={out}", "drafter.settings.ttt_steps=3",
            "drafter.settings.attn_backend=sdpa", "data.micro_batch_size=2", "data.eval_fraction=0.25",
            "data.eval_samples=8", "data.prefetch=2", "optim.lr=3e-3", "optim.warmup_steps=2",
            "run.total_steps=6", "run.save_every=3", "run.eval_every=3", "run.device=cpu",
            "run.progress_bar=false", *extra]


def run_cli(args: list[str], timeout: int = 240, env_extra: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """`python -m verl_speco.train.launcher ARGS` in a subprocess (fails the test on non-zero exit)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **(env_extra or {})}
    proc = subprocess.run([sys.executable, "-m", "verl_speco.train.launcher", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-6000:]}"
    return proc


def run_failing(args: list[str], timeout: int = 240, ranks: int = 1) -> str:
    """Run the launcher expecting a user error: exit 2, no traceback, exactly one line
    `verl-speco-draft-train: error: ...` on stderr (one per rank when `ranks` > 1), returned."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "verl_speco.train.launcher", *args], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 2, f"exit {proc.returncode}\nstdout:\n{proc.stdout[-2000:]}\nstderr:\n{proc.stderr[-4000:]}"
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]
    lines = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(lines) == ranks and all(line.startswith("verl-speco-draft-train: error: ") for line in lines), \
        proc.stderr[-4000:]
    return "\n".join(sorted(lines))
