"""scripts/drift_real_grpo.py on a named target: every arm's launcher command carries the target, the
validation reward is read under the target task's data source, and the default initial drafter is
trained on the target's answers to the run's own task."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest
from file_modules import load_script


def _script() -> Any:
    return load_script("drift_real_grpo")


def _args(**kw: Any) -> argparse.Namespace:
    base = {"target": "smollm2-135m", "steps": 12, "lr": 1e-4, "batch": 4, "n": 4, "val_prompts": 16, "seed": 1, "task": None,
            "paired": True, "overrides": ["actor_rollout_ref.rollout.drafter.schedule=serial"]}
    return argparse.Namespace(**{**base, **kw})


def test_every_arm_launches_the_named_target(tmp_path: Path) -> None:
    drift = _script()
    for arm in drift.ARMS:
        cmd = drift.arm_command(arm, tmp_path, tmp_path / "export", _args())
        assert cmd[cmd.index("--target") + 1] == "smollm2-135m"
        assert cmd[cmd.index("--out") + 1] == str(tmp_path / arm)
        assert cmd[-1] == "actor_rollout_ref.rollout.drafter.schedule=serial"  # user overrides come last
    baseline = "actor_rollout_ref.rollout.drafter.heldout_baseline=true"
    for arm in drift.ARMS:  # --paired: every arm, the frozen ones measuring the comparison's own noise
        assert baseline in drift.arm_command(arm, tmp_path, tmp_path / "export", _args())
        assert baseline not in drift.arm_command(arm, tmp_path, tmp_path / "export", _args(paired=False))
    frozen = drift.arm_command("frozen", tmp_path, tmp_path / "export", _args())
    assert "actor_rollout_ref.rollout.drafter.train_interval=13" in frozen
    assert "--task" not in frozen  # the launcher's own default task for the target
    steps = drift.arm_command("cotrained", tmp_path, tmp_path / "export", _args(task="plain_steps"))
    assert steps[steps.index("--task") + 1] == "plain_steps"


def test_validation_reward_is_read_under_the_tasks_data_source(tmp_path: Path) -> None:
    drift = _script()
    assert drift.val_reward_key("embedded") == "val-core/verl_speco/embedded/acc/mean@1"
    assert drift.val_reward_key("smollm2-135m") == "val-core/verl_speco/plain_arithmetic/acc/mean@1"
    (tmp_path / "cotrained").mkdir()
    lines = [{"step": 0, "data": {"val-core/verl_speco/plain_arithmetic/acc/mean@1": 0.5,
                                  "val-core/verl_speco/embedded/acc/mean@1": 0.9,
                                  "drafter/heldout/mean_acceptance_length": 1.25}}]
    (tmp_path / "cotrained" / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    [rec] = drift.arm_records("cotrained", tmp_path, "smollm2-135m")
    assert rec["val_reward"] == 0.5 and rec["heldout_acceptance"] == 1.25
    [rec] = drift.arm_records("cotrained", tmp_path, "embedded")
    assert rec["val_reward"] == 0.9
    assert drift.val_reward_key("smollm2-135m", "plain_steps") == "val-core/verl_speco/plain_arithmetic_steps/acc/mean@1"


def test_the_default_initial_drafter_is_trained_on_the_targets_task(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    from verl_speco.cpu_port import initial_drafter

    asked: list[tuple[Any, ...]] = []

    def fake(out: Path, target: str, task: str, train_prompts: int = 64, seed: int = 0) -> Path:
        asked.append((out, target, task, seed))
        return out / "export"

    monkeypatch.setattr(initial_drafter, "initial_drafter", fake)
    drift = _script()
    work, results = tmp_path / "w", tmp_path / "r"
    assert drift.main(["--target", "smollm2-135m", "--seed", "4", "--work", str(work), "--results", str(results),
                       "--report-only"]) == 0
    assert asked == [(work / "drafter", "smollm2-135m", "plain", 4)]
    summary = json.loads((results / "summary.json").read_text())
    assert summary["target"] == "smollm2-135m" and summary["initial_drafter"] == str(work / "drafter" / "export")
    assert drift.main(["--target", "smollm2-135m", "--task", "plain_steps", "--work", str(work),
                       "--results", str(results), "--report-only"]) == 0
    assert asked[-1] == (work / "drafter", "smollm2-135m", "plain_steps", 0)
    assert json.loads((results / "summary.json").read_text())["task"] == "plain_steps"


def test_summary_keeps_the_same_draft_gain_apart(tmp_path: Path) -> None:
    """The frozen arm's paired gain (one draft decoded twice) is the noise of the measurement, reported
    apart from the co-trained arm's gain."""
    drift = _script()
    records = [{"arm": "cotrained", "step": 3, "heldout_acceptance": 2.0, "heldout_gain": 1.5,
                "heldout_baseline_acceptance": 1.25},
               {"arm": "frozen", "step": 3, "heldout_acceptance": 1.4, "heldout_gain": 0.95}]
    summary = drift.summarize(records, {}, _args(), tmp_path)
    assert summary["paired_gain"] == {"3": 1.5}
    assert summary["paired_margin"] == {"3": 0.75}  # 2.0 served - 1.25 initial, tokens per target forward
    assert summary["same_draft_gain"] == {"frozen": {"3": 0.95}}
    assert summary["cotrained_over_frozen"] == 2.0 / 1.4
    assert "goal_window" not in summary  # no paired step in the goal's window (from step 4)


def test_summary_reports_the_goal_window(tmp_path: Path) -> None:
    drift = _script()
    records = [{"arm": "cotrained", "step": s, "heldout_acceptance": served, "heldout_baseline_acceptance": 2.0,
                "heldout_gain": served / 2.0} for s, served in ((3, 2.0), (4, 2.8), (5, 2.5))]
    records.append({"arm": "frozen", "step": 4, "heldout_acceptance": 2.0, "heldout_gain": 1.0,
                    "heldout_baseline_acceptance": 2.0})
    window = drift.summarize(records, {}, _args(), tmp_path)["goal_window"]
    assert window["steps"] == [4, 5]  # the co-trained arm only, from step 4
    assert window["margin_mean"] == pytest.approx(0.65) and window["gain_min"] == pytest.approx(1.25)
    assert (window["at_or_above"], window["met"]) == (1, False)
