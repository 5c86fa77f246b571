"""The two-stage workflow scripts/run_qwen3_8b_drafter_separate_training.sh (RUN_STAGE=both|collect|train).

Composition (every family x engine x device): stage 1 through `verl-speco`'s composition and verl's
`validate_config`, stage 2 through the trainer's typed schema, the family and its settings the same
in both stages (the store's layout is the one the trainer asks for). The end-to-end run on CPU
(`cpu_grpo`, after the main suite) is in test_separate_training_cpu.py.
"""

from __future__ import annotations

import shlex

import pytest
from test_launchers import DRAFTER, SEPARATE, launch, printed, verl_overrides

from drafters.registry import known_families
from verl_speco.launchers import cli, recipes
from verl_speco.launchers.validate import LaunchCheckError, check_trainer, check_verl

COMBOS = [(f, e, "gpu") for f in known_families() for e in recipes.ENGINES] + \
    [(f, "vllm", d) for f in known_families() for d in ("cpu", "npu")]


def stages(monkeypatch: pytest.MonkeyPatch, family: str, engine: str, device: str, stage: str = "both",
           **env: str) -> dict[str, list[str]]:
    """The stages' commands as the script builds them (in process; the script path is run below)."""
    for key in ("MODEL", "TRAIN_FILES", "VAL_FILES", "OUT", "FEATURE_DIR", "CKPT_DIR"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("HOME", "/home/user")
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    args = cli.build_parser().parse_intermixed_args(
        ["separate", "--family", family, "--engine", engine, "--device", device, "--stage", stage])
    return {s.name: s.argv for s in cli.commands(args)}


@pytest.mark.parametrize(("family", "engine", "device"), COMBOS)
def test_both_stages_compose_with_one_family_and_store(monkeypatch: pytest.MonkeyPatch, family: str, engine: str,
                                                       device: str) -> None:
    cmds = stages(monkeypatch, family, engine, device, FEATURE_DIR="/data/features", CKPT_DIR="/ckpt/x")
    assert list(cmds) == ["collect", "inspect", "train"]
    collect = verl_overrides(cmds["collect"])
    assert check_verl(collect, device) == {}  # collect_only: no draft is served
    assert f"{DRAFTER}.mode=collect_only" in collect and f"{DRAFTER}.feature_store.path=/data/features" in collect
    assert cmds["inspect"][-2:] == ["/data/features", "--strict"]
    train = cmds["train"][cmds["train"].index("--nproc-per-node") + 2:]
    cfg = check_trainer(train)
    assert (cfg.drafter.family, cfg.data.store, cfg.run.out_dir) == (family, "/data/features", "/ckpt/x")
    from verl_speco.main import compose

    rollout = compose(collect).actor_rollout_ref.rollout
    assert rollout.drafter.family == family and dict(rollout.drafter.settings) == dict(cfg.drafter.settings)
    assert dict(cfg.drafter.settings) == recipes.settings(family, device)
    if device in ("gpu", "npu"):
        assert cfg.target.path == "/home/user/models/Qwen3-8B" == compose(collect).actor_rollout_ref.model.path
        assert cfg.run.device == {"gpu": "cuda", "npu": "npu"}[device] and cfg.run.mixed_precision == "bfloat16"
        assert rollout.name == engine and compose(collect).trainer.device == ("npu" if device == "npu" else "cuda")
    else:
        assert cfg.run.device == "cpu" and collect[0] == "+speco_cpu=grpo_embedded"


def test_run_stage_selects_the_commands(monkeypatch: pytest.MonkeyPatch) -> None:
    assert list(stages(monkeypatch, "eagle3", "vllm", "gpu", "collect")) == ["collect"]
    assert list(stages(monkeypatch, "eagle3", "vllm", "gpu", "train")) == ["inspect", "train"]


def test_the_script_prints_and_checks_both_stages() -> None:
    cmds = printed(SEPARATE, DEVICE="cpu", DRAFTER="dflash", COLLECT_STEPS="2")
    assert [c[2] for c in cmds] == ["verl_speco.cpu_port.launch", "feature_store.inspect",
                                    "verl_speco.train.launcher"]
    assert "trainer.total_training_steps=2" in cmds[0] and "drafter.family=dflash" in cmds[2]
    proc = launch(SEPARATE, "--check", ENGINE="sglang", DRAFTER="domino")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "collect: config OK" in proc.stdout and "train: config OK" in proc.stdout


@pytest.mark.parametrize(("args", "env", "field"), [
    ((), {"RUN_STAGE": "trian"}, "RUN_STAGE='trian'"), ((), {"DRAFTER": "eagle4"}, "DRAFTER='eagle4'"),
    ((), {"COLLECT_STEPS": "0"}, "COLLECT_STEPS='0'"), ((), {"NPROC_PER_NODE": "two"}, "NPROC_PER_NODE='two'"),
    ((), {"DEVICE": "cpu", "ENGINE": "sglang"}, "ENGINE='sglang'"),
    ((), {"DEVICE": "npu", "ENGINE": "sglang"}, "ENGINE='sglang' with DEVICE='npu'"),
    (("--check", "--train-override", "run.total_step=3"), {}, "run.total_step"),
    (("--check", "trainer.total_training_step=3"), {}, "total_training_step"),
])
def test_bad_inputs_fail_naming_the_field(args: tuple[str, ...], env: dict[str, str], field: str) -> None:
    proc = launch(SEPARATE, *(args or ("--print",)), **env)
    assert proc.returncode == 2 and field in proc.stderr, (shlex.join(args), proc.stderr[-2000:])


def test_a_typo_in_a_stage_two_setting_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    train = stages(monkeypatch, "dspark", "vllm", "gpu")["train"]
    bad = [a.replace("settings.markov_head_type=", "settings.markov_head=") for a in train]
    with pytest.raises(LaunchCheckError, match="markov_head"):
        check_trainer(bad[bad.index("--nproc-per-node") + 2:])
