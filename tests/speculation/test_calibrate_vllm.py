"""Calibration and the schedule through real vLLM (CPU) on the cycle target with the oracle EAGLE-3
draft (tests/engines/conftest.py): its first draft position is always right and the second always
wrong, so the measured acceptance per position must be exactly [1, 0]; an engine given a plan's fields
drafts where the plan says and not elsewhere, and decodes what plain decoding decodes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from engines.conftest import VOCAB, build_cycle_target, draft_config, oracle_draft, single_cycle

from drafters.eagle3.export import export_eagle3
from verl_speco.engines.spec_metrics import SpecCounters

PROMPTS = [[7 + i, 9, 11 + i, 3] for i in range(4)]


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from drafters.common.target import TargetHead
    from verl_speco.evaluation import engine_format_of

    root = tmp_path_factory.mktemp("speculation")
    perm = single_cycle(VOCAB, seed=3)
    target = build_cycle_target(root / "target", perm)
    cfg = draft_config()
    export = export_eagle3(oracle_draft(cfg, target, perm), cfg, root / "draft")
    spec = engine_format_of(export, TargetHead.from_pretrained(target)).vllm_speculative_config(export, 2)
    return {"target": target, "export": export, "spec": spec}


@pytest.mark.vllm
def test_calibration_measures_every_arm_and_the_exact_acceptance(served: dict[str, Any], tmp_path: Path) -> None:
    from verl_speco.speculation.calibrate import calibrate
    from verl_speco.speculation.plan import Calibration

    cal = calibrate(served["target"], served["export"], served["spec"], PROMPTS, k_max=2, batch_sizes=(1, 2),
                    steps=3, warmup=1)
    assert cal.per_position == (1.0, 0.0)
    times = cal.step_times
    assert times.batch_sizes == (1, 2) and times.k_max == 2 and cal.max_num_seqs == 2
    assert all(t > 0 for row in (times.plain_step_s, *times.draft_step_s) for t in row)
    assert Calibration.read(cal.write(tmp_path / "cal.json")) == cal  # the file round trip


@pytest.mark.vllm
def test_an_engine_drafts_where_the_plan_says(served: dict[str, Any]) -> None:
    from verl_speco.engines import vllm_engine
    from verl_speco.speculation.plan import SpeculationPlan

    plan = SpeculationPlan(schedule=[(1, 1, 2), (2, 4, 0)], speculate=True, k_max=2)
    extra = {k: v for k, v in served["spec"].items() if k not in ("method", "num_speculative_tokens", "model")}
    plain = vllm_engine.build_llm(served["target"], None, max_model_len=64, max_num_seqs=4)
    try:
        expected = [vllm_engine.generate(plain, PROMPTS[:1], 12), vllm_engine.generate(plain, PROMPTS[:2], 12)]
    finally:
        vllm_engine.shutdown(plain)
    fields = plan.vllm_fields()
    llm = vllm_engine.build_llm(served["target"], served["export"], method="eagle3",
                                num_speculative_tokens=fields.pop("num_speculative_tokens"),
                                speculative_extra={**extra, **fields}, max_model_len=64, max_num_seqs=4)
    try:
        alone, one = vllm_engine.generate_with_metrics(llm, PROMPTS[:1], 12)
        pair, two = vllm_engine.generate_with_metrics(llm, PROMPTS[:2], 12)
    finally:
        vllm_engine.shutdown(llm)
    assert one["num_drafts"] > 0 and one["num_draft_tokens"] == 2 * one["num_drafts"]  # batch 1: k = 2
    assert two["num_drafts"] == 0  # batch 2: k = 0
    assert [alone, pair] == expected  # lossless


def test_a_calibration_that_timed_another_arm_is_refused() -> None:
    from verl_speco.speculation.calibrate import _require_drafts_of

    _require_drafts_of(2, SpecCounters(num_drafts=5, num_draft_tokens=10), 1)
    _require_drafts_of(0, SpecCounters(), 1)
    with pytest.raises(RuntimeError, match="expected 2 per round"):
        _require_drafts_of(2, SpecCounters(num_drafts=5, num_draft_tokens=15), 1)  # the engine drafted 3
    with pytest.raises(RuntimeError, match="expected 0 per round"):
        _require_drafts_of(0, SpecCounters(num_drafts=5, num_draft_tokens=10), 1)  # the schedule was ignored
