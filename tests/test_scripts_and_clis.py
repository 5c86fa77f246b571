"""Every script in scripts/ and every console script answers --help (or parses, for shell); the
training-step benchmark also runs end to end at its --quick shapes."""

from __future__ import annotations

import math
import os
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


def test_bench_train_step_quick_every_family() -> None:
    """`bench_train_step.py --quick --family all` runs every family's adapter end to end: the summary
    table has one row per family with a numeric ratio, finite losses on both sides and an OK check."""
    pytest.importorskip("speculators")
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from benchmarks.train_step_adapters import ADAPTERS

    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_train_step.py"), "--quick", "--family", "all",
                          "--no-memory"], capture_output=True, text=True, cwd=ROOT, timeout=600,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-6000:]
    lines = out.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("family "))
    columns = lines[header].split()
    rows = {}
    for line in lines[header + 1:]:
        cells = line.split()
        if len(cells) != len(columns):
            break
        rows[cells[0]] = dict(zip(columns, cells))
    assert sorted(rows) == sorted(ADAPTERS), lines[header:]
    for name, row in rows.items():
        ratio = float(row["ratio"])
        assert math.isfinite(ratio) and ratio > 0, (name, row)
        assert all(math.isfinite(float(row[k])) for k in ("ours_loss", "spec_loss", "ours_ms", "spec_ms")), (name, row)
        assert row["check"] == "OK", (name, row)
        assert row["ours_params"] == row["spec_params"], (name, row)
        assert row["verdict"] in ("GOAL", "PASS", "FAIL"), (name, row)
