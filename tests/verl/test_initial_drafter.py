"""`--drafter trained` for a run's own task (`verl_speco.cpu_port.initial_drafter`): the drafter is
trained on the target's answers to exactly the GRPO run's training problems, by the real collect and
train CLIs, reused once done, and a failed stage is one error naming the log."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from verl_speco.cpu_port import initial_drafter as init


def test_commands_collect_the_eagle3_layout_and_reduce_a_real_vocabulary(tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    stages = init.task_drafter_commands(tmp_path, "smollm2-135m", tmp_path / "t", prompts, 120, 1, "vllm",
                                                49152)
    collect, train = stages["collect"], stages["train"]
    assert collect[collect.index("--engine") + 1] == "vllm" and collect[collect.index("--layout-of") + 1] == "eagle3"
    assert collect[collect.index("--data") + 1] == str(prompts)
    assert collect[collect.index("--max-new-tokens") + 1] == "64"  # the GRPO preset's response length
    assert "drafter.settings.draft_vocab_size=8192" in train and "run.total_steps=120" in train
    small = init.task_drafter_commands(tmp_path, "embedded", tmp_path / "t", prompts, 2, 0, "hf", 4096)["train"]
    assert not [a for a in small if "draft_vocab_size" in a]  # a vocabulary already below 8192 is kept


def test_task_drafter_trains_on_the_runs_own_problems(tmp_path: Path) -> None:
    import pandas as pd

    from verl_speco.target.rl_data import write_rl_dataset

    out = tmp_path / "drafter"
    export = init.train_task_drafter(out, "embedded", "plain", train_prompts=8, steps=2, seed=3, engine="hf")
    assert (export / "config.json").is_file() and list(export.glob("*.safetensors"))
    asked = [json.loads(line)["messages"][0]["content"] for line in (out / "prompts.jsonl").read_text().splitlines()]
    run = pd.read_parquet(write_rl_dataset(tmp_path / "data", n_train=8, n_val=4, seed=3, task="plain")["train"])
    assert asked == [p[0]["content"] for p in run["prompt"]]  # the GRPO run's train.parquet, same order
    samples = json.loads((out / "drafter.json").read_text())
    assert samples["export"] == str(export) and samples["task"] == "plain"
    log = (out / "drafter.log").stat().st_mtime_ns
    assert init.train_task_drafter(out, "embedded", "plain", train_prompts=8, steps=2, seed=3, engine="hf") == export
    assert (out / "drafter.log").stat().st_mtime_ns == log  # reused: nothing ran again


def test_a_failed_stage_names_the_log(tmp_path: Path) -> None:
    out = tmp_path / "drafter"
    out.mkdir()
    bad = {"collect": [init.sys.executable, "-m", "verl_speco.capture.collect", "--target", "embedded", "--data",
            str(tmp_path / "missing.jsonl"), "--store", str(out / "store")]}
    with pytest.raises(RuntimeError, match=r"collect exited 2; log .*drafter\.log"):
        init._run_logged(bad, out / "drafter.log")
    assert "missing.jsonl" in (out / "drafter.log").read_text()
