"""Every script in scripts/ and every console script answers --help (or parses, for shell)."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PY_SCRIPTS = sorted((ROOT / "scripts").glob("*.py"))
SH_SCRIPTS = sorted((ROOT / "scripts").glob("*.sh")) + [ROOT / ".ci" / "run"]
CONSOLE = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]


@pytest.mark.parametrize("script", PY_SCRIPTS, ids=lambda p: p.name)
def test_python_script_help(script: Path) -> None:
    out = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, cwd=ROOT,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "usage:" in out.stdout


@pytest.mark.parametrize("script", SH_SCRIPTS, ids=lambda p: p.name)
def test_shell_script_parses(script: Path) -> None:
    out = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "set -euo pipefail" in script.read_text()


@pytest.mark.parametrize("name", sorted(CONSOLE))
def test_console_script_help(name: str) -> None:
    module, func = CONSOLE[name].split(":")
    code = f"import sys; from {module} import {func}; sys.exit({func}(['--help']))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "usage:" in out.stdout and name in out.stdout


def test_ci_runs_the_readme_test_command() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "bash scripts/run_tests.sh" in readme and "bash scripts/quickstart.sh" in readme
    assert "bash scripts/run_tests.sh" in (ROOT / ".ci" / "run").read_text()
