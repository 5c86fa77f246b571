"""The two-stage standalone workflow (scripts/run_qwen3_8b_drafter_separate_training.sh, RUN_STAGE):
1. collect: verl GRPO with the drafter `collect_only` into FEATURE_DIR (no draft served, so any engine);
2. train: `verl-speco-inspect-features --strict`, then `verl-speco-draft-train` into CKPT_DIR with the same
   family and settings, resuming from its latest complete checkpoint.
On CPU stage 1 is `verl_speco.cpu_port.launch` and stage 2 trains at the quickstart presets' sizes."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

from verl_speco.launchers import recipes
from verl_speco.launchers.inputs import Inputs
from verl_speco.launchers.online import (
    DRAFTER,
    drafter_overrides,
    grpo_overrides,
    hydra_value,
    settings_overrides,
)

STAGES = ("both", "collect", "train")
GPU_TRAIN = ["run.device=cuda", "run.dtype=float32", "run.mixed_precision=bfloat16", "data.max_seq_len=4096",
             "data.micro_batch_size=4", "data.eval_fraction=0.01", "optim.lr=6e-4", "optim.warmup_ratio=0.04",
             "optim.denominators=prepass", "run.save_every=500", "run.log_every=10"]
NPU_TRAIN = ["run.device=npu", *GPU_TRAIN[1:]]  # HCCL, the dense-mask attention path (verl_speco/train)
CPU_TRAIN = ["run.device=cpu", "run.dtype=float32", "data.max_seq_len=512", "data.micro_batch_size=8",
             "optim.lr=1e-3", "run.log_every=1", "run.progress_bar=false"]


@dataclass
class Stage:
    name: str  # collect | inspect | train
    argv: list[str]  # the full command
    overrides: list[str] = field(default_factory=list)  # its Hydra overrides (what --check composes)


def cpu_stage(name: str, inputs: Inputs, draft: str | None, overrides: list[str]) -> Stage:
    """A verl stage on the CPU platform: `verl_speco.cpu_port.launch` with `overrides` (the whole
    `verl-speco` list) after its preset."""
    from verl_speco.cpu_port.launch import launch_command
    from verl_speco.target.build import target_path

    out = Path(inputs.out)
    data = {"train": out / "data" / "train.parquet", "val": out / "data" / "val.parquet"}
    verl = launch_command(target_path(), data, out, Path(draft) if draft else None, overrides)
    argv = [sys.executable, "-m", "verl_speco.cpu_port.launch", "--out", str(out),
            "--drafter", draft or "fresh", *overrides]
    return Stage(name, argv, verl[verl.index("verl_speco.main") + 1:])


def collect_overrides(family: str, engine: str, device: str, inputs: Inputs) -> list[str]:
    """Stage 1 (GPU: the `verl-speco` overrides; CPU: what `cpu_port.launch` appends to its preset)."""
    store = [f"{DRAFTER}.feature_store.path={hydra_value(inputs.feature_dir)}",
             f"trainer.total_training_steps={inputs.collect_steps}"]
    drafter = drafter_overrides(family, device, "collect_only")
    if device == "cpu":
        return [*drafter, *store, f"trainer.experiment_name=cpu_collect_{family}"]
    return [*grpo_overrides(inputs, engine, device), *drafter, *store, f"{DRAFTER}.caps.max_rows=64",
            f"{DRAFTER}.caps.max_tokens=65536", f"{DRAFTER}.caps.max_seq_len=5120",
            f"trainer.experiment_name=qwen3_8b_collect_{family}_{engine}"]


def train_overrides(family: str, device: str, inputs: Inputs, target: str) -> list[str]:
    """Stage 2's `verl-speco-draft-train` overrides (the trainer's own config, configs/draft_trainer.yaml)."""
    values = recipes.settings(family, device)
    return [f"target.path={hydra_value(target)}", f"data.store={hydra_value(inputs.feature_dir)}",
            f"run.out_dir={hydra_value(inputs.ckpt_dir)}", "~drafter", f"drafter.family={family}",
            *settings_overrides("drafter", values), f"run.total_steps={inputs.train_steps}", "run.resume=true",
            *({"gpu": GPU_TRAIN, "npu": NPU_TRAIN}.get(device) or [*CPU_TRAIN, f"run.save_every={inputs.train_steps}"])]


def stages(family: str, engine: str, device: str, stage: str, inputs: Inputs, target: str,
           collect_extra: list[str], train_extra: list[str]) -> list[Stage]:
    """The commands of `stage` (both | collect | train), in order; `target` is stage 2's target directory."""
    recipes.check_choice("RUN_STAGE", stage, STAGES)
    py = sys.executable
    out: list[Stage] = []
    if stage in ("both", "collect"):
        overrides = [*collect_overrides(family, engine, device, inputs), *collect_extra]
        if device == "cpu":
            out.append(cpu_stage("collect", inputs, None, overrides))
        else:
            out.append(Stage("collect", [py, "-m", "verl_speco.main", *overrides], overrides))
    if stage in ("both", "train"):
        out.append(Stage("inspect", [py, "-m", "feature_store.inspect", inputs.feature_dir, "--strict"]))
        overrides = [*train_overrides(family, device, inputs, target), *train_extra]
        out.append(Stage("train", [py, "-m", "verl_speco.train.launcher", "--nproc-per-node", inputs.nproc_per_node,
                                   *overrides], overrides))
    return out
