"""scripts/bench_feature_store.py --encodings-only through its CLI, small: one row per drafter family at
Qwen3-8B sizes where fp8 takes half of bf16's bytes per token (hidden states dominate: 4096 values per
layer against 9 bytes of ids and mask and 4 bytes of scale per field), checked on disk too, and the
throughput table for both encodings."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from drafters.registry import known_families

ROOT = Path(__file__).resolve().parents[2]
FAMILY_ROW = re.compile(r"^\s+(\w+)\s+([\d,]*(?:\+last)?)\s+([\d,]+)\s+([\d,]+)\s+(\d\.\d{3})\s+(\d\.\d{3})$")
ENCODING_ROW = re.compile(r"^\s+(raw|fp8_e4m3)\s+([\d,]+)\s+([\d,]+)\s+([\d,]+)$")


def test_encodings_section(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_feature_store.py"), "--encodings-only", "--samples", "6",
           "--min-tokens", "16", "--max-tokens", "64", "--hidden", "256", "--repeats", "1",
           "--encoding-tokens", "32", "--no-drop-caches", "--root", str(tmp_path)]
    out = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    families = {m[1]: m for line in out.stdout.splitlines() if (m := FAMILY_ROW.match(line))}
    assert sorted(families) == sorted(known_families()), out.stdout
    for name, m in families.items():
        ids = m[2].removesuffix("+last")
        layers, last = (len(ids.split(",")) if ids else 0), int(m[2].endswith("+last"))
        bf16, fp8 = int(m[3].replace(",", "")), int(m[4].replace(",", ""))
        assert bf16 == 9 + (layers + last) * 4096 * 2, (name, m[0])         # ids int64 + mask u8 + bf16 hidden
        scales = 4 * (int(layers > 0) + last)                               # one float32 per token per field
        assert fp8 == 9 + (layers + last) * 4096 + scales, (name, m[0])     # e4m3 + the scales
        assert float(m[5]) <= 0.502 and abs(float(m[6]) - float(m[5])) <= 0.01, (name, m[0])   # on disk too
    assert families["eagle3"][2] == "2,18,33+last"
    encodings = {m[1]: [int(v.replace(",", "")) for v in m.groups()[1:]]
                 for line in out.stdout.splitlines() if (m := ENCODING_ROW.match(line))}
    assert sorted(encodings) == ["fp8_e4m3", "raw"], out.stdout
    assert all(w > 0 and r > 0 for w, r, _ in encodings.values())
    assert encodings["fp8_e4m3"][2] < 0.6 * encodings["raw"][2]
