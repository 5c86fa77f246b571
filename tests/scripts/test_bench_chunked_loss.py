"""scripts/bench_chunked_loss.py end to end through its CLI at tiny shapes where the logits dominate
(rows 512, vocab 8000, hidden 32: one [rows, V] float32 buffer is 16 MB, the weights 1 MB): the table
has the unchunked row and one row per chunk size, the unchunked ratios are 1, and the chunked loss's
peak is a fraction of the unchunked one (observed: unchunked 81 MB; chunk 64: 15 MB, ratio 0.19; chunk 128: ~0.3)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "bench_chunked_loss.py"
ROWS, VOCAB, HIDDEN, CHUNKS = 512, 8000, 32, (64, 128)
LOGITS_MB = ROWS * VOCAB * 4 / 2**20  # one [rows, V] float32 buffer
ROW = re.compile(r"^\s*(unchunked|\d+)\s+(\d+)\s+(\d+\.\d{3})\s+(\d+\.\d{2})\s+(\d+\.\d{3})\s*$")


def test_table_rows_and_peak_ratio_at_tiny_shapes() -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}  # the checkout's drafters, in every child
    cmd = [sys.executable, str(SCRIPT), "--rows", str(ROWS), "--vocab", str(VOCAB), "--hidden", str(HIDDEN),
           "--chunks", *map(str, CHUNKS), "--device", "cpu"]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    lines = out.stdout.splitlines()
    assert lines[0].startswith(f"rows {ROWS}, vocab {VOCAB}, hidden {HIDDEN}, cpu"), out.stdout
    assert lines[1].split() == ["chunk", "peak", "MB", "peak", "ratio", "seconds", "time", "ratio"], out.stdout
    rows = {}
    for line in lines[2:]:
        m = ROW.match(line)
        assert m, f"unparsed table row {line!r}:\n{out.stdout}"
        rows[m[1]] = (float(m[2]), float(m[3]), float(m[4]), float(m[5]))
    assert list(rows) == ["unchunked", *map(str, CHUNKS)], out.stdout
    base_mb, base_ratio, base_s, base_time_ratio = rows["unchunked"]
    assert base_ratio == 1.0 and base_time_ratio == 1.0
    # unchunked: at least the draft logits, the rebuilt target distribution and the logits' gradient alive
    assert base_mb >= 2 * LOGITS_MB, out.stdout
    for chunk in CHUNKS:
        mb, ratio, seconds, time_ratio = rows[str(chunk)]
        assert abs(ratio - mb / base_mb) <= 0.5 / base_mb + 1e-3, (chunk, out.stdout)  # MB printed rounded
        # at most a quarter of the rows' logits alive at once (+ the weights' gradient): well under half
        assert 0.0 <= ratio <= 0.5, (chunk, out.stdout)
        assert seconds >= 0.0 and time_ratio >= 0.0
    assert rows["64"][0] <= rows["128"][0] + 1, out.stdout  # smaller chunks: no larger peak (1 MB rounding)
