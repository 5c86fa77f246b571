"""scripts/gpu_check.sh (-> scripts/gpu_check.py, benchmarks/attention_checks.py): the GPU check's code
path on CPU with tiny shapes (SDPA training, flex only in the mask checks, FSDP2 over gloo), and its
instruments against planted faults. The CUDA run itself needs an H100/H200 (see the script)."""

from __future__ import annotations

import importlib.metadata
import json
import math
import os
import re
import subprocess
from pathlib import Path

import pytest
import torch

from benchmarks import attention_checks as checks
from drafters.common.attention import attend
from drafters.common.masks import AttentionMask, ttt_attention_mask

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"
FAMILIES = ("eagle1", "eagle2", "eagle3", "dflash", "dspark", "domino", "peagle")


def run(*args: str, timeout: int = 900) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHON": str(ROOT / ".venv" / "bin" / "python")}
    env.pop("WHEELS", None)
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout, env=env)


def test_cpu_smoke_run_steps_every_family_and_checks_its_masks(tmp_path: Path) -> None:
    report = tmp_path / "report.json"
    proc = run("--device", "cpu", "--tiny", "--steps", "1", "--json", str(report))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    data = json.loads(report.read_text())
    rows = {r["family"]: r for r in data["rows"]}
    assert tuple(sorted(rows)) == tuple(sorted(FAMILIES)) and data["backend"] == "gloo"
    for name, r in rows.items():
        assert r["ok"] and all(math.isfinite(x) for x in r["losses"]) and r["step_ms"] > 0, (name, r)
        assert r["flops_per_step"] > 0 and r["mfu"] is None and r["peak_gib"] is None, (name, r)
        assert r["masks"] and all(m["elementwise"] and m["blocks"] and m["outputs"] for m in r["masks"]), name
        assert r["flex_calls"] == 0  # CPU trains with SDPA; flex runs in the mask checks only
    assert len(rows["eagle3"]["masks"]) == 7  # one TTT mask per step: the recorder sees every attention call
    assert {k: v for k, v in rows["eagle2"].items() if k != "family"} == \
        {k: v for k, v in rows["eagle1"].items() if k != "family"}
    assert "eagle2*" in proc.stdout and "MFU" in proc.stdout and "within" in proc.stdout


class WrongDense(AttentionMask):
    """A mask whose dense form disagrees with its mask function (one extra visible pair)."""

    def dense(self, device: torch.device | str = "cpu") -> torch.Tensor:
        out = super().dense(device).clone()
        out[0, 0, 0, -1] = True
        return out


def test_mask_check_passes_equal_masks_and_fails_a_planted_difference() -> None:
    valid = torch.ones(2, 300, dtype=torch.bool)
    valid[1, 150:] = False  # a padded row: the block structure is not uniform over the batch
    for good in (ttt_attention_mask(valid, step=0), ttt_attention_mask(valid[:, :200], step=2)):
        result = checks.check_mask(good, torch.device("cpu"))
        assert result.ok and result.max_diff < 1e-4, result
    causal = ttt_attention_mask(valid, step=0)
    # row 0 sees key 299: a pair in the (rows 0-127, keys 256-299) block, which holds no visible pair
    wrong = checks.check_mask(WrongDense(causal.mask_mod, causal.batch, causal.q_len, causal.kv_len),
                              torch.device("cpu"))
    assert not wrong.elementwise and not wrong.blocks and not wrong.outputs and not wrong.ok, wrong


def test_attention_flops_count_visible_pairs_only() -> None:
    causal = ttt_attention_mask(torch.ones(1, 4, dtype=torch.bool), step=0)  # 4 + 3 + 2 + 1 = 10 pairs
    rec = checks.Recorded([(causal, (1, 2, 4, 8)), (causal, (1, 2, 4, 8)), (None, (1, 2, 4, 8))])
    assert checks.attention_flops(rec, torch.device("cpu")) == 3 * 4 * 8 * 2 * (10 + 10 + 16)
    assert len(rec.masks()) == 1


def test_flex_comparison_flags_a_wrong_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(1, 4, 40, 8, generator=g), torch.randn(1, 2, 40, 8, generator=g), torch.randn(1, 2, 40, 8,
                                                                                                       generator=g)
    mask = ttt_attention_mask(torch.ones(1, 40, dtype=torch.bool), step=0)
    with checks.compare_flex_to_dense() as stats:
        attend(q, k, v, mask, "flex")
    assert (stats.calls, stats.failures, stats.dtypes) == (1, 0, {"float32"}) and stats.max_diff < 1e-4
    import drafters.common.attention as attention_module

    monkeypatch.setattr(attention_module, "_flex", lambda q, k, v, mask: torch.zeros_like(q))
    with checks.compare_flex_to_dense() as stats:
        attend(q, k, v, mask, "flex")
    assert stats.failures == 1 and stats.max_diff > 0.1


def test_the_wheels_it_installs_are_the_venvs_versions() -> None:
    pins = re.search(r"WHEEL_PINS=\(([^)]*)\)", SCRIPT.read_text())
    assert pins is not None
    for pin in pins.group(1).split():
        name, version = pin.split("==")
        assert importlib.metadata.version(name) == version, pin


def test_a_bad_flag_fails_naming_it() -> None:
    proc = run("--device", "cpu", "--families", "eagle4")
    assert proc.returncode == 2 and "--families: got ['eagle4']" in proc.stderr, proc.stderr[-2000:]
