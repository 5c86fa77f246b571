"""scripts/bench_eagle1_step.py end to end through its CLI at tiny shapes: its check line shows the fused and
the checkpointed head loss giving the same loss and gradients, and the table has one row per path with the
chunked path as the ratio's base. A planted fault in the fused path's backward (the saved gradient not scaled
by the incoming one) shows as a gradient difference of about 1 and fails the check.

`--compare precision`: the bf16 model's loss and gradients are within bf16 rounding of float32's, and not equal
to them (a wrapper that silently computed in float32 would show a difference near 0 and fail), with float32 as
the table's base."""

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


def _run(*extra: str) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, str(SCRIPT), *TINY, *extra], capture_output=True, text=True, cwd=ROOT,
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


PRECISION_CHECK = re.compile(r"^check: loss bfloat16 (\S+), float32 (\S+); largest gradient difference (\S+) of")
PRECISION_ROW = re.compile(r"^\s*(bfloat16|float32)\s+(\d+\.\d{3})\s+(\d+\.\d{3})\s*$")


def test_precision_axis() -> None:
    lines = _run("--compare", "precision").splitlines()
    assert lines[0].startswith("EAGLE-1 step: vocab 500, hidden 32, batch 3 x 40, 30 loss rows"), lines
    m = PRECISION_CHECK.match(lines[1])
    assert m, lines
    bf16, fp32, grad_diff = map(float, m.groups())
    # bf16 keeps 8 bits of mantissa (relative rounding 2^-8 = 3.9e-3 per value); float32 sums of bf16 products
    # stay within a few of those: the tiny run measures 2.3e-5 on the loss and 9.7e-3 on the gradients
    assert bf16 == pytest.approx(fp32, rel=2e-3) and fp32 > 0, lines
    assert 1e-4 < grad_diff < 0.1, lines
    rows = {m[1]: (float(m[2]), float(m[3])) for line in lines[3:] if (m := PRECISION_ROW.match(line))}
    assert list(rows) == ["bfloat16", "float32"] and rows["float32"][1] == 1.0, lines
