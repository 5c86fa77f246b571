"""The CPU run's pieces that need no Ray: the rule-reward dataset and reward, the preset, the launcher."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
from speco_verl_helpers import ROOT, compose


def test_rl_dataset_has_verls_columns_and_disjoint_splits(tmp_path: Path) -> None:
    import pandas as pd

    from verl_speco.target.rl_data import DATA_SOURCE, write_rl_dataset

    paths = write_rl_dataset(tmp_path, n_train=6, n_val=3)
    train, val = pd.read_parquet(paths["train"]), pd.read_parquet(paths["val"])
    assert len(train) == 6 and len(val) == 3
    assert {"data_source", "prompt", "ability", "reward_model", "extra_info"} <= set(train.columns)
    row = train.iloc[0]
    assert row["data_source"] == DATA_SOURCE and row["prompt"][0]["role"] == "user"
    assert row["reward_model"]["style"] == "rule" and row["reward_model"]["ground_truth"]
    prompts = {p[0]["content"] for p in train["prompt"]}
    assert not prompts & {p[0]["content"] for p in val["prompt"]}


def test_plain_arithmetic_rows_and_reward(tmp_path: Path) -> None:
    import pandas as pd

    from verl_speco.target.rl_data import PLAIN_SOURCE, PLAIN_STEPS_SOURCE, compute_score, write_rl_dataset

    paths = write_rl_dataset(tmp_path, n_train=40, n_val=10, task="plain")
    train, val = pd.read_parquet(paths["train"]), pd.read_parquet(paths["val"])
    for row in pd.concat([train, val]).itertuples():
        a, b = int(row.extra_info["a"]), int(row.extra_info["b"])
        expected = a + b if row.ability == "add" else a - b  # recomputed from the operands
        word = "plus" if row.ability == "add" else "minus"
        assert row.prompt[0]["content"] == f"What is {a} {word} {b}? Reply with the number."
        assert row.reward_model["ground_truth"] == str(expected) and expected >= 0
        assert row.data_source == PLAIN_SOURCE
    assert not {p[0]["content"] for p in train["prompt"]} & {p[0]["content"] for p in val["prompt"]}
    assert len(set(train["prompt"].map(lambda p: p[0]["content"]))) == 40  # distinct problems
    with pytest.raises(ValueError, match=r"n_train \+ n_val: got 100 \+ 30, expected <= 126"):
        write_rl_dataset(tmp_path, n_train=100, n_val=30, task="plain")
    assert compute_score(PLAIN_SOURCE, "47 + 8 = 55", "55") == 1.0
    assert compute_score(PLAIN_SOURCE, "The sum is 55, or maybe 56", "55") == 0.25
    assert compute_score(PLAIN_SOURCE, "I think it is 155.", "55") == 0.0  # digits inside a number do not count
    assert compute_score(PLAIN_SOURCE, "no idea", "55") == 0.0
    with pytest.raises(ValueError, match="task: got 'poems'"):
        write_rl_dataset(tmp_path, task="poems")
    steps = write_rl_dataset(tmp_path / "steps", n_train=40, n_val=10, task="plain_steps")
    for split in ("train", "val"):  # the very problems of task plain, asked for a worked answer
        plain_rows, steps_rows = pd.read_parquet(paths[split]), pd.read_parquet(steps[split])
        for plain_row, row in zip(plain_rows.itertuples(), steps_rows.itertuples(), strict=True):
            question = plain_row.prompt[0]["content"].removesuffix(" Reply with the number.")
            assert row.prompt[0]["content"] == f"{question} Think step by step, then give the answer."
            assert row.reward_model["ground_truth"] == plain_row.reward_model["ground_truth"]
            assert row.data_source == PLAIN_STEPS_SOURCE
    worked = "1. Add 7 to 8: 7 + 8 = 15\n\nSo, the answer is 15."
    assert compute_score(PLAIN_STEPS_SOURCE, worked, "15") == 1.0
    assert compute_score(PLAIN_STEPS_SOURCE, worked, "8") == 0.25


def test_rule_reward() -> None:
    from verl_speco.target.corpus import generate_examples
    from verl_speco.target.rl_data import compute_score

    ex = generate_examples(1, split="train")[0]
    info = {"reference": ex.response}
    assert compute_score("x", ex.response, ex.answer, info) == 1.0
    lines = ex.response.splitlines()
    half = compute_score("x", lines[0] + "\n" + lines[1], ex.answer, info)
    assert half == 0.5 * 2 / len(lines)
    assert compute_score("x", "The answer is 0.", ex.answer, info) == 0.0 or ex.answer == "0"
    assert compute_score("x", "nonsense", ex.answer, None) == 0.0


def test_the_cpu_preset_composes_the_measured_recipe() -> None:
    cfg = compose(["+speco_cpu=grpo_embedded"])
    a = cfg.actor_rollout_ref
    assert a.actor.strategy == "fsdp2" and a.actor.fsdp_config.strategy == "fsdp2"
    assert a.model.override_config.attn_implementation == "sdpa"
    assert a.rollout.enable_sleep_mode is False and a.rollout.load_format == "auto"
    assert a.rollout.engine_kwargs.vllm.worker_extension_cls == \
        "verl_speco.cpu_port.vllm_worker.CPUSpecoWorkerExtension"
    assert a.rollout.drafter.enable and a.rollout.drafter.mode == "online"
    assert cfg.ray_kwargs.ray_init.num_gpus == 1 and cfg.ray_kwargs.ray_init.num_cpus == 16
    assert cfg.trainer.device == "cpu" and "file" in cfg.trainer.logger


def test_the_launcher_finds_the_quickstart_drafter_and_builds_the_command(tmp_path: Path) -> None:
    from verl_speco.cpu_port.launch import PRESET, launch_command, quickstart_drafter

    assert quickstart_drafter(tmp_path) is None
    export = tmp_path / "checkpoints" / "step_300" / "export"
    export.mkdir(parents=True)
    (export / "config.json").write_text("{}")
    assert quickstart_drafter(tmp_path) == export
    data = {"train": tmp_path / "t.parquet", "val": tmp_path / "v.parquet"}
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "config.json").write_text('{"hidden_size": 64, "vocab_size": 512}')
    (tmp_path / "config.json").write_text('{"hidden_size": 64, "vocab_size": 512}')
    cmd = launch_command(tmp_path / "target", data, tmp_path / "out", export, ["trainer.total_training_steps=5"])
    assert cmd[1:4] == ["-m", "verl_speco.main", PRESET] and cmd[-1] == "trainer.total_training_steps=5"
    assert f"actor_rollout_ref.rollout.drafter.model_path={export}" in cmd
    assert any(c.startswith("reward.custom_reward_function.path=") and c.endswith("rl_data.py") for c in cmd)
    assert not any("model_path" in c for c in launch_command(tmp_path, data, tmp_path, None, []))


def test_the_weight_bucket_fits_the_targets_largest_tensor(tmp_path: Path) -> None:
    import json

    from verl_speco.cpu_port.launch import weight_bucket_megabytes
    from verl_speco.target.named import target_config

    smollm2 = {"hidden_size": 576, "vocab_size": 49152, "intermediate_size": 1536}
    embedding_mib = 49152 * 576 * 4 / 2**20  # 108.0: the float32 embedding verl syncs as one tensor
    assert weight_bucket_megabytes(smollm2) == 135 and weight_bucket_megabytes(smollm2) > embedding_mib
    assert weight_bucket_megabytes({"hidden_size": 64, "vocab_size": 512}) == 64  # the preset's bucket is the floor
    (tmp_path / "config.json").write_text(json.dumps(smollm2))
    assert target_config(tmp_path) == smollm2
    with pytest.raises(FileNotFoundError, match="no config.json there"):
        target_config(tmp_path / "missing")


def test_the_unbuilt_embedded_target_is_planned_from_its_recipe(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A launcher's --print plans the embedded target's run before it is built (a fresh HOME)."""
    from verl_speco.cpu_port.launch import launch_command
    from verl_speco.target.build import default_recipe, target_path
    from verl_speco.target.named import target_config

    monkeypatch.setenv("VERL_SPECO_CACHE", str(tmp_path / "cache"))
    planned = target_path(default_recipe())
    assert not planned.exists()
    cfg = target_config(planned)
    spec = default_recipe().model
    assert (cfg["hidden_size"], cfg["vocab_size"], cfg["intermediate_size"]) == (
        spec.hidden_size, default_recipe().vocab_size, spec.intermediate_size)
    data = {"train": tmp_path / "t.parquet", "val": tmp_path / "v.parquet"}
    cmd = launch_command(planned, data, tmp_path / "out", None, [])
    assert "actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes=64" in cmd


def test_a_real_target_gets_plain_english_problems() -> None:
    from verl_speco.cpu_port.launch import build_parser, rl_task

    assert rl_task("embedded", None) == "corpus" and rl_task("smollm2-135m", None) == "plain"
    assert rl_task("smollm2-135m", "corpus") == "corpus"
    assert build_parser().parse_args(["--task", "plain"]).task == "plain"
    assert build_parser().parse_args(["--task", "plain_steps"]).task == "plain_steps"


def test_the_launcher_refuses_a_drafter_directory_without_an_export(tmp_path: Path) -> None:
    from verl_speco.cpu_port.launch import main

    assert main(["--out", str(tmp_path / "out"), "--drafter", str(tmp_path)]) == 2
    assert not (tmp_path / "out").exists()  # refused before anything was built or written
    out = subprocess.run(["bash", str(ROOT / "scripts" / "run_cpu_grpo.sh"), "--help"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and "usage: run_cpu_grpo" in out.stdout


FAKE_VERL = """
import json, os, sys
print("(pid=1) INFO verl and vLLM noise"); print("ray noise", file=sys.stderr)
with open(os.environ["VERL_FILE_LOGGER_PATH"], "w") as f:
    for step in (1, 2):
        f.write(json.dumps({"step": step, "data": {"critic/score/mean": 0.5 * step, "drafter/version": step}}) + "\\n")
sys.exit(int(sys.argv[1]))
"""


@pytest.mark.parametrize("rc", [0, 3])
def test_the_launcher_is_quiet_and_ends_with_a_summary_or_the_logs_tail(
        rc: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]) -> None:
    """The run's output goes to <out>/run_cpu_grpo.log; the terminal gets the bars and the last step's
    figures, or, when the run fails, its exit status and the log's last lines (a stand-in for verl)."""
    import sys

    from verl_speco.cpu_port import launch as cpu_launch
    from verl_speco.target import named

    monkeypatch.setattr(named, "resolve_target", lambda name, log=print: log("target noise") or tmp_path)
    monkeypatch.setattr(cpu_launch, "launch_command", lambda *a: [sys.executable, "-c", FAKE_VERL, str(rc)])
    out = tmp_path / "out"
    assert cpu_launch.main(["--out", str(out), "--drafter", "fresh", "trainer.total_training_steps=2"]) == rc
    term = capfd.readouterr()
    log = (out / cpu_launch.LOG).read_text()
    for noise in ("target noise", "verl and vLLM noise", "ray noise"):
        assert noise in log and (noise in term.err) == (rc != 0) and noise not in term.out
    if rc == 0:
        assert "[run_cpu_grpo] exit 0" in term.out and "2 GRPO steps" in term.out
        assert "step 2: score mean 1, drafter version 2" in term.out
        assert "GRPO steps" in term.err and "2/2" in term.err
    else:
        assert "[run_cpu_grpo] exit 3" in term.err and "RunFailed" in term.err
