"""What a user sets for a launcher: environment variables, their defaults, their checks.

GPU and NPU (DEVICE=gpu|npu, Qwen3-8B class):
  MODEL         target, a local Hugging Face directory (default ~/models/Qwen3-8B)
  TRAIN_FILES   training prompts, verl's parquet (default ~/data/gsm8k/train.parquet)
  VAL_FILES     held-out prompts (default ~/data/gsm8k/test.parquet)
  DRAFT_PATH    initial drafter export for online co-training (default: a fresh one)
  PUBLISH_DIR   where online versions are published (default /dev/shm/verl_speco/qwen3_8b_<family>_<engine>)
  RL_GPUS, DRAFTER_GPUS   verl's GPUs and the drafter actors' on the node (default 6 and 2)
CPU (DEVICE=cpu, the embedded target and its rule-reward dataset; MODEL, TRAIN_FILES and
VAL_FILES are refused there): OUT, the run directory (default runs/cpu_<workflow>_<family>).
Two-stage workflow, both devices:
  FEATURE_DIR   Feature Store stage 1 writes and stage 2 reads (default <OUT>/features)
  CKPT_DIR      stage 2's checkpoints and exports (default <OUT>/checkpoints)
  COLLECT_STEPS GRPO steps of stage 1 (default gpu 50, cpu 2); TRAIN_STEPS optimizer steps of
                stage 2 (default gpu 2000, cpu 20); NPROC_PER_NODE trainer processes (default gpu auto, cpu 1)
  OUT           default runs/qwen3_8b_<family>_separate (gpu)"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from verl_speco.launchers.recipes import RecipeError

CPU_REFUSED = ("MODEL", "TRAIN_FILES", "VAL_FILES")


@dataclass(frozen=True)
class Inputs:
    model: str | None  # None on cpu: the embedded target
    train_files: str | None
    val_files: str | None
    draft_path: str | None
    publish_dir: str | None
    rl_gpus: int
    drafter_gpus: int
    out: str
    feature_dir: str
    ckpt_dir: str
    collect_steps: int
    train_steps: int
    nproc_per_node: str


def _positive(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name, "").strip()
    if not raw:
        return default
    if not raw.isdigit() or int(raw) < 1:
        raise RecipeError(f"{name}={raw!r}: expected an integer >= 1")
    return int(raw)


def _path(env: Mapping[str, str], name: str, default: str | None, absolute: bool = True) -> str | None:
    """`name` from `env` (else `default`), `~` expanded; made absolute (against the working directory,
    the repository root under the launchers) unless `absolute` is False (MODEL may be a hub id)."""
    raw = env.get(name, "").strip() or default
    if raw is None:
        return None
    path = Path(raw).expanduser()
    return str(path.resolve() if absolute else path)


def read_inputs(family: str, engine: str, device: str, workflow: str,
                env: Mapping[str, str] | None = None) -> Inputs:
    """The inputs of a `workflow` ("online" or "separate") launch from `env` (default os.environ)."""
    env = os.environ if env is None else env
    home = Path(env.get("HOME") or Path.home())
    gpu = device != "cpu"  # gpu or npu: the same inputs
    if not gpu:
        given = [name for name in CPU_REFUSED if env.get(name, "").strip()]
        if given:
            raise RecipeError(f"{given[0]}={env[given[0]]!r} with DEVICE='cpu': the CPU launchers run the embedded "
                              "target and its rule-reward dataset (verl_speco/target); expected it unset")
    suffix = "_npu" if device == "npu" else ""
    default_out = f"runs/qwen3_8b_{family}_{workflow}{suffix}" if gpu else f"runs/cpu_{workflow}_{family}"
    out = _path(env, "OUT", default_out)
    assert out is not None
    nproc = env.get("NPROC_PER_NODE", "").strip() or ("auto" if gpu else "1")
    if nproc != "auto" and (not nproc.isdigit() or int(nproc) < 1):
        raise RecipeError(f"NPROC_PER_NODE={nproc!r}: expected auto or an integer >= 1")
    return Inputs(
        model=_path(env, "MODEL", str(home / "models" / "Qwen3-8B"), absolute=False) if gpu else None,
        train_files=_path(env, "TRAIN_FILES", str(home / "data" / "gsm8k" / "train.parquet"), False) if gpu else None,
        val_files=_path(env, "VAL_FILES", str(home / "data" / "gsm8k" / "test.parquet"), False) if gpu else None,
        draft_path=_path(env, "DRAFT_PATH", None),
        publish_dir=_path(env, "PUBLISH_DIR", f"/dev/shm/verl_speco/qwen3_8b_{family}_{engine}{suffix}" if gpu else None),
        rl_gpus=_positive(env, "RL_GPUS", 6),
        drafter_gpus=_positive(env, "DRAFTER_GPUS", 2),
        out=out,
        feature_dir=_path(env, "FEATURE_DIR", str(Path(out) / "features")) or "",
        ckpt_dir=_path(env, "CKPT_DIR", str(Path(out) / "checkpoints")) or "",
        collect_steps=_positive(env, "COLLECT_STEPS", 50 if gpu else 2),
        train_steps=_positive(env, "TRAIN_STEPS", 2000 if gpu else 20),
        nproc_per_node=nproc,
    )
