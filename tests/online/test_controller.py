"""`OnlineController` against a scripted drafter: when rounds start, when they are collected, when they
are published, the metrics' names and values, and the publish bookkeeping of the rollout servers.
Every expectation is written out by hand from the config (train_interval, publish_interval, schedule)."""

from __future__ import annotations

from typing import Any

import pytest

from verl_speco.engines.spec_metrics import SpecCounters
from verl_speco.online.config import DrafterRunConfig
from verl_speco.online.controller import OnlineController, capture_step


class ScriptedLink:
    """A drafter that logs every call; a round's metrics carry its number, a publish its version."""

    def __init__(self, steps: int = 2):
        self.steps = steps
        self.log: list[str] = []
        self.started = self.finished = self.version = 0

    def add(self, rows: list[Any], head: Any) -> dict[str, float]:
        self.log.append(f"add{len(rows)}")
        return {"rows_added": float(len(rows))}

    def next_round_steps(self) -> int:
        return self.steps

    def start_round(self) -> int:
        self.started += 1
        self.log.append(f"start{self.started}")
        return self.started

    def wait_round(self, handle: int) -> dict[str, float]:
        self.finished += 1
        self.log.append(f"wait{handle}")
        return {"loss": 1.0 / handle, "steps": float(self.steps)}

    def publish(self) -> dict[str, Any]:
        self.version += 1
        self.log.append(f"publish{self.version}")
        return {"version": self.version, "path": f"/shm/v{self.version}", "bytes": 10 * self.version, "seconds": 0.5}


def _cfg(**kw: Any) -> DrafterRunConfig:
    return DrafterRunConfig(enable=True, mode="online", **kw).validate()


def _run(ctl: OnlineController, steps: int) -> list[dict[str, float]]:
    return [ctl.end_step(s, s == steps, ["r0", "r1"], "head") for s in range(1, steps + 1)]


def test_serial_trains_every_train_interval_and_publishes_every_publish_interval() -> None:
    link = ScriptedLink()
    ctl = OnlineController(_cfg(train_interval=2, publish_interval=2), link)
    logged = _run(ctl, 6)
    # rounds at steps 2, 4, 6 (train_interval=2), collected at once; published after rounds 2 (step 4)
    assert link.log == ["add2", "add2", "start1", "wait1", "add2", "add2", "start2", "wait2", "publish1",
                        "add2", "add2", "start3", "wait3"]
    assert [m.get("drafter/steps") for m in logged] == [None, 2.0, None, 2.0, None, 2.0]
    assert [m.get("drafter/version") for m in logged] == [None, None, None, 1.0, None, None]
    assert logged[3]["drafter/publish_bytes"] == 10.0 and logged[3]["drafter/publish_seconds"] == 0.5
    assert logged[1]["drafter/loss"] == 1.0 and logged[3]["drafter/loss"] == 0.5
    assert logged[0] == {"drafter/rows_added": 2.0}
    assert {"drafter/train_wait_seconds", "drafter/train_wall_seconds"} <= logged[1].keys()
    assert ctl.rounds == 3 and ctl.latest is not None and ctl.latest["version"] == 1


def test_overlap_collects_at_the_next_step_and_the_last_step_collects_its_own() -> None:
    link = ScriptedLink()
    ctl = OnlineController(_cfg(schedule="overlap"), link)
    logged = _run(ctl, 3)
    # step 1 starts round 1; step 2 collects and publishes it before adding its rows, then starts round 2;
    # step 3 (the last) collects round 2, then starts and collects its own round 3
    assert link.log == ["add2", "start1", "wait1", "publish1", "add2", "start2", "wait2", "publish2", "add2",
                        "start3", "wait3", "publish3"]
    assert "drafter/version" not in logged[0] and logged[1]["drafter/version"] == 1.0
    assert logged[2]["drafter/version"] == 3.0 and not ctl.in_flight


def test_a_round_in_flight_is_never_published_or_started_twice() -> None:
    ctl = OnlineController(_cfg(schedule="overlap"), ScriptedLink())
    ctl.end_step(1, False, ["r"], "head")
    with pytest.raises(RuntimeError, match="in flight"):
        ctl.publish()
    with pytest.raises(RuntimeError, match="still in flight"):
        ctl.maybe_train(2, False)
    assert ctl.collect(publish=False)["drafter/steps"] == 2.0 and ctl.latest is None  # collected, not published


def test_nothing_captured_skips_the_round_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    link = ScriptedLink(steps=0)
    ctl = OnlineController(_cfg(), link)
    assert _run(ctl, 2) == [{"drafter/rows_added": 2.0}] * 2 and link.started == 0
    assert capsys.readouterr().out.count("skipping this round") == 1
    with pytest.raises(RuntimeError, match="without a target-head snapshot"):
        ctl.end_step(3, False, ["r"], None)


def test_fresh_samples_leave_the_round_to_after_the_fresh_rows() -> None:
    link = ScriptedLink()
    ctl = OnlineController(_cfg(fresh_samples=4, capture_pass="post_update"), link)
    assert ctl.end_step(1, False, ["r"], "head") == {"drafter/rows_added": 1.0} and link.started == 0
    assert ctl.add(["f"], "head", "drafter/fresh") == {"drafter/fresh/rows_added": 1.0}
    assert ctl.maybe_train(1, False)["drafter/version"] == 1.0


def test_capture_steps_follow_collect_interval() -> None:
    assert [s for s in range(1, 9) if capture_step(_cfg(collect_interval=3), s)] == [1, 4, 7]


def test_rollout_acceptance_excludes_the_windows_counted_aside() -> None:
    ctl = OnlineController(_cfg(), ScriptedLink())
    assert ctl.acceptance(None) == {}
    step1 = ctl.acceptance(SpecCounters(10, 30, 15, (8, 5, 2)))  # 10 drafts, 15 accepted -> 1 + 15/10
    assert step1["drafter/accept/mean_acceptance_length"] == 2.5 and step1["drafter/accept/pos1"] == 0.8
    # validation drafts 4 (6 accepted: 4, 2, 0 by position): its own metrics, kept out of the next step
    held = ctl.count_aside(SpecCounters(10, 30, 15, (8, 5, 2)), SpecCounters(14, 42, 21, (12, 7, 2)), "drafter/heldout")
    assert held["drafter/heldout/num_drafts"] == 4.0 and held["drafter/heldout/mean_acceptance_length"] == 2.5
    assert [held[f"drafter/heldout/pos{i}"] for i in (1, 2, 3)] == [1.0, 0.5, 0.0]
    # step 2's rollout: 2 more drafts, 1 accepted (position 1) -> only those
    step2 = ctl.acceptance(SpecCounters(16, 48, 22, (13, 7, 2)))
    assert step2["drafter/accept/num_drafts"] == 2.0 and step2["drafter/accept/mean_acceptance_length"] == 1.5
    assert ctl.acceptance(SpecCounters(16, 48, 22, (13, 7, 2))) == {"drafter/accept/num_drafts": 0.0}
    assert ctl.count_aside(None, SpecCounters(), "drafter/fresh") == {}


def test_publish_bookkeeping_loads_the_newest_and_never_offers_a_refused_version_again() -> None:
    ctl = OnlineController(_cfg(), ScriptedLink())
    assert ctl.to_load("a") is None and ctl.held("a") == -1  # nothing published yet
    ctl.publish()
    assert ctl.to_load("a") == {"version": 1, "path": "/shm/v1", "bytes": 10, "seconds": 0.5}
    ctl.record_load("a", 1, "loaded", [], ["digest"], 0.25)
    assert ctl.held("a") == 1 and ctl.to_load("a") is None and ctl.digests["a"] == ["digest"]
    assert ctl.to_load("b") is not None  # another replica group keeps its own account
    ctl.publish()
    ctl.record_load("a", 2, "rejected", ["torn"], None, 0.1)
    assert ctl.held("a") == 1 and ctl.to_load("a") is None  # still serving v1; v2 not offered again
    ctl.record_served([1, 1])
    assert ctl.consume_sync_metrics() == {"drafter/publish_load_seconds": 0.25, "drafter/served_version_min": 1.0,
                                          "drafter/publish_rejected_total": 1.0}
    assert ctl.consume_sync_metrics() == {}
    ctl.publish()
    pub = ctl.to_load("a")
    assert pub is not None and pub["version"] == 3
