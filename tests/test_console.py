"""verl_speco.console: what the applications' quiet mode sends where, child processes included, and
what a failure shows."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

APP = textwrap.dedent("""
    import logging, os, subprocess, sys, warnings
    from verl_speco.console import Console

    console = Console(sys.argv[1], verbose=sys.argv[2] == "verbose", name="app")
    logging.basicConfig(level=logging.INFO)
    with console:
        with console.stage("work", total=3) as bar:
            print("python stdout line")
            print("python stderr line", file=sys.stderr)
            os.write(1, b"fd 1 line\\n")
            logging.getLogger("engine").info("engine logger line")
            warnings.warn("library warning line")
            subprocess.run([sys.executable, "-c", "import sys; print('child stdout line'); "
                            "print('child stderr line', file=sys.stderr)"], check=True)
            bar.update(2)
            if sys.argv[3] == "fail":
                raise RuntimeError("the engine died")
    console.print("RESULT table line")
""")

NOISE = ("python stdout line", "python stderr line", "fd 1 line", "engine logger line", "library warning line",
         "child stdout line", "child stderr line")


def _run(tmp_path: Path, mode: str, outcome: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    log = tmp_path / "run" / "app.log"
    proc = subprocess.run([sys.executable, "-c", APP, str(log), mode, outcome], capture_output=True, text=True,
                          cwd=ROOT, timeout=120, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    return proc, log


def test_quiet_sends_every_writer_to_the_log_and_keeps_results_and_bars(tmp_path: Path) -> None:
    proc, log = _run(tmp_path, "quiet", "ok")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == "RESULT table line\n"
    text = log.read_text()
    for line in NOISE:
        assert line in text and line not in proc.stdout + proc.stderr, line
    assert f"app: engine and library logs: {log}" in proc.stderr
    assert "work" in proc.stderr and "3/3" in proc.stderr  # the bar, filled at the stage's end


def test_quiet_failure_shows_the_error_and_the_logs_tail(tmp_path: Path) -> None:
    proc, log = _run(tmp_path, "quiet", "fail")
    assert proc.returncode == 1
    assert "RESULT" not in proc.stdout
    assert "child stderr line" in proc.stderr  # the log's last lines
    assert "RuntimeError: the engine died" in proc.stderr and str(log) in proc.stderr
    assert "Traceback" in log.read_text()


def test_verbose_leaves_the_logs_on_the_terminal(tmp_path: Path) -> None:
    proc, log = _run(tmp_path, "verbose", "ok")
    assert proc.returncode == 0, proc.stderr
    for line in NOISE:
        assert line in proc.stdout + proc.stderr, line
    assert proc.stdout.endswith("RESULT table line\n")
    assert not log.exists()
