"""`verl-speco-draft-train` argument normalisation (--dry-run) and --help of the CLIs."""

from __future__ import annotations

import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from verl_speco.train.launcher import LaunchError, build_command, build_parser, main

PY = "/usr/bin/python3-test"


def _cmd(argv: list[str], env: dict[str, str] | None = None) -> list[str]:
    cmd, _ = build_command(build_parser().parse_args(argv), env=env or {}, python=PY)
    return cmd


def test_single_process_runs_in_process() -> None:
    cmd, torchrun = build_command(build_parser().parse_args(["--nproc-per-node", "1", "run.total_steps=3"]),
                                  env={}, python=PY)
    assert (cmd, torchrun) == ([PY, "-m", "verl_speco.train.entry", "run.total_steps=3"], False)


def test_single_node_many_processes_uses_standalone_torchrun() -> None:
    assert _cmd(["--nproc-per-node", "2", "data.store=/s", "preset=quickstart_eagle3"]) == [
        PY, "-m", "torch.distributed.run", "--nproc-per-node=2", "--standalone", "--nnodes=1",
        "-m", "verl_speco.train.entry", "data.store=/s", "preset=quickstart_eagle3"]


def test_nproc_from_environment() -> None:
    assert _cmd([], env={"NPROC_PER_NODE": "4"})[3] == "--nproc-per-node=4"


def test_multi_node_c10d_from_arguments() -> None:
    cmd = _cmd(["--nnodes", "2", "--nproc-per-node", "8", "--node-rank", "1", "--master-addr", "10.0.0.1",
                "--master-port", "29600", "--rdzv-id", "job7", "--config-name", "draft_trainer", "a.b=1"])
    assert cmd == [PY, "-m", "torch.distributed.run", "--nproc-per-node=8", "--nnodes=2", "--rdzv-backend=c10d",
                   "--rdzv-endpoint=10.0.0.1:29600", "--rdzv-id=job7", "--node-rank=1",
                   "-m", "verl_speco.train.entry", "a.b=1"]


def test_multi_node_from_environment_and_explicit_endpoint() -> None:
    env = {"NNODES": "4", "NODE_RANK": "3", "MASTER_ADDR": "head", "NPROC_PER_NODE": "2"}
    assert _cmd([], env=env)[3:] == ["--nproc-per-node=2", "--nnodes=4", "--rdzv-backend=c10d",
                                     "--rdzv-endpoint=head:29500", "--rdzv-id=verl-speco", "--node-rank=3",
                                     "-m", "verl_speco.train.entry"]
    assert "--rdzv-endpoint=other:1234" in _cmd(["--rdzv-endpoint", "other:1234"], env=env)


def test_multi_node_static_rendezvous() -> None:
    cmd = _cmd(["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "static", "--node-rank", "0",
                "--master-addr", "h"])
    assert cmd[3:8] == ["--nproc-per-node=1", "--nnodes=2", "--node-rank=0", "--master-addr=h", "--master-port=29500"]
    with pytest.raises(LaunchError, match="node-rank"):
        _cmd(["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "static", "--master-addr", "h"])


def test_multi_node_without_rendezvous_fails_by_name() -> None:
    with pytest.raises(LaunchError, match="rdzv-endpoint"):
        _cmd(["--nnodes", "2", "--nproc-per-node", "1"])


def test_dry_run_prints_the_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--dry-run", "--nproc-per-node", "2", "--config-dir", "/cfg", "run.total_steps=5"]) == 0
    printed = shlex.split(capsys.readouterr().out.strip())
    assert printed[1:] == ["-m", "torch.distributed.run", "--nproc-per-node=2", "--standalone", "--nnodes=1",
                           "-m", "verl_speco.train.entry", "--config-dir", "/cfg", "run.total_steps=5"]
    assert printed[0] == sys.executable


def test_bad_arguments_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as err:
        main(["--dry-run", "--nnodes", "2", "--nproc-per-node", "1"])
    assert err.value.code == 2
    assert "rdzv-endpoint" in capsys.readouterr().err


def test_config_errors_are_reported_before_torchrun(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--nproc-per-node", "2", "data.store=/s", "target.path=/t", "optim.lr=fast"]) == 2
    err = capsys.readouterr().err
    assert err == "verl-speco-draft-train: error: optim.lr='fast': expected a float (Value 'fast' of type 'str' " \
                  "could not be converted to Float)\n"


@pytest.mark.parametrize("argv", [
    [sys.executable, "-m", "verl_speco.train.launcher", "--help"],
    [sys.executable, "-m", "verl_speco.train.entry", "--help"],
])
def test_help(argv: list[str]) -> None:
    out = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=True).stdout
    assert "--config-dir" in out and "overrides" in out
    if "launcher" in argv[2]:
        assert "--nproc-per-node" in out and "--dry-run" in out and "--rdzv-endpoint" in out


def test_console_script_help() -> None:
    exe = Path(sys.executable).parent / "verl-speco-draft-train"
    if not exe.exists():
        exe = Path(shutil.which("verl-speco-draft-train") or exe)
    if not exe.exists():
        pytest.skip("verl-speco-draft-train console script not installed (pip install -e .)")
    out = subprocess.run([str(exe), "--help"], capture_output=True, text=True, timeout=120, check=True).stdout
    assert out.startswith("usage: verl-speco-draft-train")


def test_print_config(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--nproc-per-node", "1", "--print-config", "target.path=/t", "data.store=/s",
                 "preset=quickstart_eagle3"]) == 0
    out = capsys.readouterr().out
    assert "total_steps: 300" in out and "store: /s" in out
