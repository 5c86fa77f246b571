"""The two-stage workflow end to end on CPU: `DEVICE=cpu bash scripts/run_qwen3_8b_drafter_separate_training.sh`
on the embedded target (real verl GRPO in collect_only mode on the CPU platform, then the store
inspected and a DFlash drafter trained from it), then `RUN_STAGE=train` again with more steps.

Marked `cpu_grpo` (scripts/run_tests.sh runs these after the main suite): stage 1 takes both cores
for a minute or two. Sizes: 2 GRPO steps of 2 prompts x 2 samples (4 rows a step), 4 + 2 trainer steps.

Checks: the run exits 0; the store passes `verl-speco-inspect-features --strict --verify-checksums`
and holds every row the run reported writing (`drafter/store/samples`, cumulative, > 0); the trainer
wrote an export that our DFlash loader loads against the target and whose config is the
recipe's (block 4); the second invocation resumed from the first one's checkpoint (step 4 -> 6).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from speco_verl_helpers import ROOT
from test_launchers import SEPARATE, launch

pytestmark = [pytest.mark.cpu_grpo, pytest.mark.timeout(1800)]
FAMILY = "dflash"


def test_collect_then_train_on_cpu(tmp_path: Path) -> None:
    env = {"DEVICE": "cpu", "DRAFTER": FAMILY, "OUT": str(tmp_path), "FEATURE_DIR": str(tmp_path / "store"),
           "CKPT_DIR": str(tmp_path / "ckpt"), "COLLECT_STEPS": "2", "TRAIN_STEPS": "4"}
    started = time.perf_counter()
    proc = launch(SEPARATE, timeout=1500, **env)
    wall = time.perf_counter() - started
    (tmp_path / "both.log").write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    assert proc.returncode == 0, f"rc {proc.returncode}; log {tmp_path / 'both.log'}:\n{proc.stderr[-6000:]}"
    print(f"RUN_STAGE=both on CPU: {wall:.1f} s wall")

    metrics = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines() if x.strip()]
    written = [int(m["data"]["drafter/store/samples"]) for m in metrics if "drafter/store/samples" in m["data"]]
    assert len(written) == 2 and 0 < written[0] <= written[1], written
    inspect = subprocess.run([sys.executable, "-m", "feature_store.inspect", str(tmp_path / "store"), "--strict",
                              "--verify-checksums", "--json"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert inspect.returncode == 0, inspect.stdout[-3000:] + inspect.stderr[-3000:]
    report = json.loads(inspect.stdout)
    assert report["summary"]["samples"] == written[-1], (report["summary"], written)

    exports = sorted((tmp_path / "ckpt").glob("**/export/config.json"))
    assert exports, "draft-train wrote no export"
    target = Path(json.loads((tmp_path / "launch.json").read_text())["target"])
    from drafters.common.target import TargetHead
    from drafters.registry import export_family, get_family

    export = exports[-1].parent
    assert export_family(export) == FAMILY
    model = get_family(FAMILY).load_export(export, TargetHead.from_pretrained(target))
    assert get_family(FAMILY).config_of(model).block_size == 4
    assert "verl-speco-draft-train: done" in proc.stdout and "'step': 4" in proc.stdout, proc.stdout[-2000:]

    started = time.perf_counter()
    again = launch(SEPARATE, timeout=600, **{**env, "RUN_STAGE": "train", "TRAIN_STEPS": "6"})
    assert again.returncode == 0, again.stderr[-4000:]
    print(f"RUN_STAGE=train (resume 4 -> 6): {time.perf_counter() - started:.1f} s wall")
    assert "[launcher] collect" not in again.stdout and "'step': 6" in again.stdout, again.stdout[-2000:]
    assert "'resumed_from': None" in proc.stdout and "'resumed_from': '" in again.stdout, again.stdout[-2000:]
