"""The README's main job end to end, on real components: embedded target -> collect -> train ->
export -> real vLLM (CPU) with the drafter, against the reference decoder and an untrained drafter."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
VLLM_LOG_LINE = re.compile(r"pid=\d+\) (INFO|WARNING|DEBUG) \d\d-\d\d ")  # vllm.logger's format

# The whole quickstart runs once per module (a few minutes on an idle 2-core machine; much longer
# when other jobs share the cores), so this module gets its own, longer timeout.
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(3600)]


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """`verl-speco-quickstart --out DIR` as a user runs it (its own process, default output)."""
    out = tmp_path_factory.mktemp("quickstart")
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    proc = subprocess.run([sys.executable, "-m", "verl_speco.quickstart", "--out", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=3500)
    assert proc.returncode == 0, f"rc {proc.returncode}\n{proc.stdout}\n{proc.stderr[-6000:]}"
    return {"out": out, "stdout": proc.stdout, "stderr": proc.stderr,
            "report": json.loads((out / "report.json").read_text())}


@pytest.fixture(scope="module")
def report(quickstart: dict[str, Any]) -> dict:
    return quickstart["report"]


def test_default_output_is_short_and_the_logs_chart_and_summary_are_files(quickstart: dict[str, Any]) -> None:
    """A few lines on stdout (the table and two paths), one bar per stage on stderr; vLLM's log lines
    (its engine core's included) only in the log file; the chart a PNG; summary.json the table's figures."""
    out, stdout, stderr = quickstart["out"], quickstart["stdout"], quickstart["stderr"]
    lines = stdout.splitlines()
    assert len(lines) < 40, stdout
    log = out / "quickstart.log"
    assert f"engine and library logs: {log}" in stderr
    assert VLLM_LOG_LINE.search(log.read_text()), "no vLLM log line in the log file"
    assert not VLLM_LOG_LINE.search(stdout + stderr), "vLLM log lines on the terminal"
    for stage in ("build target", "collect train: generate", "collect train: capture", "collect eval: generate",
                  "collect eval: capture", "train", "export", "evaluate"):
        assert re.search(rf"{stage} +100%", stderr), stage
    assert "estimate: about " in stderr and "s a training step here" in stderr
    chart, summary_path = out / "acceptance_per_position.png", out / "summary.json"
    assert f"chart: {chart}" in lines and f"summary: {summary_path}" in lines
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads(summary_path.read_text())
    assert summary["columns"] == ["vLLM trained", "reference", "vLLM untrained"]
    title = next(i for i, line in enumerate(lines) if line.startswith(f"{summary['family']} drafter on the "))
    assert re.split(r"\s{2,}", lines[title + 1].strip()) == summary["columns"]
    for i, (label, values) in enumerate(summary["rows"].items()):
        cells = re.split(r"\s{2,}", lines[title + 2 + i].strip())
        assert cells[0] == label and [float(c) for c in cells[1:]] == values, (lines[title + 2 + i], values)
    vllm, ref = quickstart["report"]["vllm"], quickstart["report"]["reference"]
    runs = (vllm["trained"], ref, vllm["untrained"])
    assert summary["rows"]["mean acceptance length"] == [round(r["mean_acceptance_length"], 3) for r in runs]
    assert summary["rows"]["drafts"] == [r["num_drafts"] for r in runs]


def test_speculative_decoding_is_lossless_in_vllm(report: dict) -> None:
    for name, run in report["vllm"].items():
        assert run["lossless"], f"{name}: greedy outputs differ with speculative decoding"
        assert run["num_drafts"] > 0


def test_trained_drafter_is_accepted_far_more_than_untrained(report: dict) -> None:
    trained, untrained = report["vllm"]["trained"], report["vllm"]["untrained"]
    assert trained["mean_acceptance_length"] >= untrained["mean_acceptance_length"] + 0.5
    assert trained["mean_acceptance_length"] >= 2.0


def test_reference_decoder_agrees_with_vllm(report: dict) -> None:
    ref, trained = report["reference"], report["vllm"]["trained"]
    assert trained["matches_reference_outputs"]
    assert abs(ref["mean_acceptance_length"] - trained["mean_acceptance_length"]) <= 0.05
    for a, b in zip(ref["per_position_acceptance_rate"], trained["per_position_acceptance_rate"]):
        assert abs(a - b) <= 0.05


def test_training_logged_and_checkpointed(report: dict) -> None:
    export = Path(report["export"])
    assert (export / "config.json").is_file() and (export / "model.safetensors").is_file()
    metrics = [json.loads(line) for line in (export.parents[2] / "metrics.jsonl").read_text().splitlines()]
    evals = [m for m in metrics if m["kind"] == "eval"]
    assert evals, "no held-out evaluation was logged"
    assert "sim_accept_len" in evals[-1] and "acc_step0" in evals[-1]


def test_speculation_auto_plans_from_its_calibration_and_is_lossless(quickstart: dict[str, Any]) -> None:
    """The default `--speculation auto`: the schedule is the plan of the calibration it reports (planned
    again here from the file's figures), the planned engine decodes what plain decoding does, and the
    table says so."""
    from verl_speco.speculation.plan import Calibration, plan

    trial = quickstart["report"]["speculation"]
    raw = trial["calibration"]
    calibration = Calibration.from_dict(raw, "report.json: speculation.calibration")
    assert [list(r) for r in plan(calibration).schedule] == trial["schedule"]
    assert trial["lossless"] and calibration.max_num_seqs == len(trial["lengths"])
    summary = json.loads((quickstart["out"] / "summary.json").read_text())["speculation"]
    assert summary["lossless"] is True and summary["requests"] == len(trial["lengths"])
    assert any(line.startswith("speculation auto (calibrated here): ") for line in quickstart["stdout"].splitlines())
