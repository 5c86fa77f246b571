"""The README's main job end to end, on real components: embedded target -> collect -> train ->
export -> real vLLM (CPU) with the drafter, against the reference decoder and an untrained drafter."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

# The whole quickstart runs once per module (a few minutes on an idle 2-core machine; much longer
# when other jobs share the cores), so this module gets its own, longer timeout.
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(3600)]


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    from verl_speco.quickstart import main

    out = tmp_path_factory.mktemp("quickstart")
    assert main(["--out", str(out)]) == 0
    return json.loads((out / "report.json").read_text())


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
