"""The Qwen3-8B launchers in our own GPU and Ascend images, which install verl-speco into the image's
interpreter and have no `.venv` (docker/Dockerfile.gpu-*, Dockerfile.ascend; .dockerignore drops it).

Each launcher is copied with its body (scripts/lib/launch.sh) into a checkout without `.venv` and run
with `--print` and PYTHON unset: it must start `python3` from PATH (here a wrapper that records its call
and runs this interpreter, where verl_speco is installed as in the images). A checkout with `.venv`
still uses it, and with neither the launcher exits 2 naming what it looked for.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
LAUNCHERS = sorted((ROOT / "scripts").glob("run_qwen3_8b_*.sh"))
INPUTS = ("PYTHON", "MODEL", "TRAIN_FILES", "VAL_FILES", "DRAFT_PATH", "PUBLISH_DIR", "OUT", "FEATURE_DIR",
          "CKPT_DIR", "ENGINE", "DEVICE", "DRAFTER", "RUN_STAGE", "COLLECT_STEPS", "TRAIN_STEPS", "NPROC_PER_NODE",
          "RL_GPUS", "DRAFTER_GPUS", "VIRTUAL_ENV")
BASH = shutil.which("bash") or "/bin/bash"


def wrapper(path: Path, mark: Path, name: str) -> Path:
    """An interpreter that appends `name` to `mark`, then runs this test's Python."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"#!/bin/sh\necho {name} >> '{mark}'\nexec '{sys.executable}' \"$@\"\n")
    path.chmod(0o755)
    return path


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    """The launchers and their body, without a .venv."""
    root = tmp_path / "checkout"
    (root / "scripts" / "lib").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "lib" / "launch.sh", root / "scripts" / "lib" / "launch.sh")
    for script in LAUNCHERS:
        shutil.copy(script, root / "scripts" / script.name)
    return root


def run(script: Path, path: str, **env: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if k not in INPUTS}
    return subprocess.run([BASH, str(script), "--print"], capture_output=True, text=True, timeout=120,
                          env={**clean, "HOME": "/home/user", "PATH": path, **env})


def test_the_launchers_have_no_venv_in_the_images() -> None:
    assert len(LAUNCHERS) == 7, LAUNCHERS  # six online families and the two-stage workflow
    assert ".venv" in (ROOT / ".dockerignore").read_text().split()


@pytest.mark.parametrize("launcher", LAUNCHERS, ids=lambda p: p.stem.removeprefix("run_qwen3_8b_"))
def test_each_launcher_prints_with_the_images_python3(checkout: Path, tmp_path: Path, launcher: Path) -> None:
    mark = tmp_path / "calls"
    bin_dir = wrapper(tmp_path / "bin" / "python3", mark, "python3").parent
    proc = run(checkout / "scripts" / launcher.name, f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert mark.read_text().split() == ["python3"]
    assert " -m verl_speco." in proc.stdout and "actor_rollout_ref.rollout.drafter.family=" in proc.stdout


def test_a_checkout_with_a_venv_uses_it(checkout: Path, tmp_path: Path) -> None:
    mark = tmp_path / "calls"
    bin_dir = wrapper(tmp_path / "bin" / "python3", mark, "python3").parent
    wrapper(checkout / ".venv" / "bin" / "python", mark, "venv")
    proc = run(checkout / "scripts" / "run_qwen3_8b_eagle3.sh", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert mark.read_text().split() == ["venv"]


def test_no_interpreter_at_all_is_named(checkout: Path, tmp_path: Path) -> None:
    bare = tmp_path / "bare"  # only what the scripts need besides an interpreter
    bare.mkdir()
    for tool in ("dirname", "bash"):
        found = shutil.which(tool)
        assert found is not None, tool
        (bare / tool).symlink_to(found)
    proc = run(checkout / "scripts" / "run_qwen3_8b_eagle3.sh", str(bare))
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "PYTHON is unset, there is no .venv/bin/python" in proc.stderr and "no python3 on PATH" in proc.stderr
