"""scripts/bench_eagle1_step.py end to end through its CLI at tiny shapes: its check line shows the fused and
the checkpointed head loss giving the same loss and gradients, and the table has one row per path with the
chunked path as the ratio's base. A planted fault in the fused path's backward (the saved gradient not scaled
by the incoming one) shows as a gradient difference of about 1 and fails the check."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "bench_eagle1_step.py"
TINY = ["--vocab", "500", "--hidden", "32", "--heads", "4", "--kv-heads", "2", "--intermediate", "64",
        "--seq", "40", "--chunk-rows", "7", "--steps", "2"]
CHECK = re.compile(r"^check: loss fused (\S+), chunked (\S+); largest gradient difference (\S+) of")
ROW = re.compile(r"^\s*(fused|chunked)\s+(\d+\.\d{3})\s+(\d+\.\d{3})\s*$")


def _run() -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, str(SCRIPT), *TINY], capture_output=True, text=True, cwd=ROOT,
                         env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    return out.stdout


def test_check_line_and_table() -> None:
    lines = _run().splitlines()
    assert lines[0].startswith("EAGLE-1 step: vocab 500, hidden 32, batch 3 x 40, 30 loss rows, chunk 7"), lines
    m = CHECK.match(lines[1])
    assert m, lines
    fused, chunked, grad_diff = map(float, m.groups())
    assert fused == pytest.approx(chunked, rel=1e-6) and fused > 0  # float32: summation order only
    assert grad_diff < 1e-4, lines
    assert lines[2].split() == ["path", "median", "s", "ratio"]
    rows = {m[1]: (float(m[2]), float(m[3])) for line in lines[3:] if (m := ROW.match(line))}
    assert list(rows) == ["fused", "chunked"] and rows["chunked"][1] == 1.0, lines
    (fused_s, ratio), chunked_s = rows["fused"], rows["chunked"][0]
    assert chunked_s > 0 and fused_s > 0, lines
    slack = ratio * 5e-4 * (1 / fused_s + 1 / chunked_s) + 1e-3  # the medians are printed to 1 ms
    assert abs(ratio - fused_s / chunked_s) <= slack, lines
