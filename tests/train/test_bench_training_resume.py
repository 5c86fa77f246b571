"""`scripts/bench_family_acceptance.py`: a training run stopped part way resumes from its newest
checkpoint when the benchmark is run again with the same settings, and ends with the same weights as
an uninterrupted run; other settings start the run directory over."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from file_modules import load_script
from safetensors.torch import load_file

bench = load_script("bench_family_acceptance")

# The tiny target's EAGLE-3 (quickstart preset) over 6 steps, a checkpoint every 2 steps.
ARGV = ["--k", "3", "--steps", "6", "--train-set", "run.save_every=2", "--train-set", "data.micro_batch_size=2",
        "--train-set", "data.eval_samples=4", "--train-set", "run.eval_every=0",
        "--train-set", "drafter.settings.attn_backend=sdpa"]


class Stopped(Exception):
    pass


def _train(tiny_target: Path, tiny_store: Path, out: Path, *extra: str, stop_at: int | None = None) -> dict[str, Any]:
    args = bench._parser().parse_args([*ARGV, "--out", str(out), *extra])

    def on_step(step: int, total: int) -> None:
        if step == stop_at:
            raise Stopped(f"stopped after step {step}")

    return bench._train(args, "eagle3", tiny_target, {"train": tiny_store, "eval": tiny_store}, out,
                        on_step=on_step)


def _weights(export: Path) -> dict[str, torch.Tensor]:
    return load_file(str(export / "model.safetensors"))


def test_a_stopped_training_run_resumes_and_equals_an_uninterrupted_one(tiny_target: Path, tiny_store: Path,
                                                                       tmp_path: Path) -> None:
    whole = _train(tiny_target, tiny_store, tmp_path / "whole")
    assert whole["resumed_from"] is None
    with pytest.raises(Stopped):
        _train(tiny_target, tiny_store, tmp_path / "cut", stop_at=5)  # checkpoints at steps 2 and 4
    resumed = _train(tiny_target, tiny_store, tmp_path / "cut")
    assert resumed["resumed_from"] is not None and Path(resumed["resumed_from"]).name == "step_4"
    want, got = _weights(whole["export"]), _weights(resumed["export"])
    assert want.keys() == got.keys() and all(torch.equal(want[k], got[k]) for k in want)
    assert resumed["tokens_seen"] == whole["tokens_seen"]
    # Finished: the cached result, no training.
    assert _train(tiny_target, tiny_store, tmp_path / "cut", stop_at=1)["export"] == resumed["export"]


def test_other_settings_start_the_run_over(tiny_target: Path, tiny_store: Path, tmp_path: Path) -> None:
    with pytest.raises(Stopped):
        _train(tiny_target, tiny_store, tmp_path, stop_at=3)  # a checkpoint at step 2
    other_seed = _train(tiny_target, tiny_store, tmp_path, "--seed", "1")
    assert other_seed["resumed_from"] is None and Path(other_seed["export"]).parent.name == "step_6"
