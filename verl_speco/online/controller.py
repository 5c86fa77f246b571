"""`OnlineController`: the one schedule of online drafter co-training (verl trainer and drift study):
when a round trains (every `train_interval` steps), is collected (`serial` at once, `overlap` at the next
step's boundary) and published, the servers' publish bookkeeping and per-window `drafter/...` acceptance
metrics. No verl, no ray: the drafter is whatever implements `DrafterLink`."""

from __future__ import annotations

import logging
import time
from collections.abc import Hashable
from typing import Any, Protocol

from verl_speco.engines.spec_metrics import SpecCounters, acceptance_summary
from verl_speco.online.config import DrafterRunConfig

logger = logging.getLogger(__name__)


class DrafterLink(Protocol):
    """The drafter as the controller drives it (one call at a time, from one thread)."""

    def add(self, rows: list[Any], head: Any) -> dict[str, float]:
        """Buffer one step's rows (one item per capturing rank) with the head of their policy version."""
        ...

    def next_round_steps(self) -> int:
        """Optimizer steps the next round would run (0: nothing to learn from)."""
        ...

    def start_round(self) -> Any:
        """Start a round of `next_round_steps()` steps; a handle for `wait_round`. Returns at once
        (the round runs elsewhere) or after the round (in line): the controller waits either way."""
        ...

    def wait_round(self, handle: Any) -> dict[str, float]:
        """The started round's metrics (`DrafterSession.train_round`'s), once it has finished."""
        ...

    def publish(self) -> dict[str, Any]:
        """Publish the draft as the next version: {"version", "path", "bytes", "seconds"}."""
        ...


def capture_step(cfg: DrafterRunConfig, step: int) -> bool:
    """Whether RL step `step` (1-based) captures rows: every `collect_interval` steps from the first
    (collect_only runs too, which have no controller)."""
    return (step - 1) % cfg.collect_interval == 0


def acceptance_metrics(delta: SpecCounters, prefix: str) -> dict[str, float]:
    """`prefix/num_drafts`, `mean_acceptance_length`, `draft_acceptance_rate`, `pos<i>` of one window."""
    summary = acceptance_summary(delta)
    if not summary["num_drafts"]:  # no draft in this window, or a server without counters (SGLang)
        return {f"{prefix}/num_drafts": 0.0}
    out = {f"{prefix}/num_drafts": float(summary["num_drafts"]),
           f"{prefix}/mean_acceptance_length": float(summary["mean_acceptance_length"]),
           f"{prefix}/draft_acceptance_rate": float(summary["draft_acceptance_rate"])}
    for i, rate in enumerate(summary["per_position_acceptance_rate"]):
        out[f"{prefix}/pos{i + 1}"] = float(rate)
    return out


class OnlineController:
    """Schedule, rounds, publishes and drafter metrics of one online run (module docstring)."""

    def __init__(self, cfg: DrafterRunConfig, link: DrafterLink):
        self.cfg = cfg
        self.link = link
        self.rounds = 0  # rounds collected
        self.latest: dict[str, Any] | None = None  # the newest publish {"version", "path", ...}
        self.last_round: dict[str, float] | None = None  # the newest collected round's own metrics
        self._round: Any = None  # the handle of a round in flight
        self._round_started = 0.0
        self._warned: set[str] = set()
        self.counters = SpecCounters()  # the rollout servers' cumulative counters, rollout windows only
        self.loaded: dict[Hashable, int] = {}  # replica group -> the version it loaded last
        self.refused: dict[Hashable, int] = {}  # replica group -> the newest version it refused
        self.digests: dict[Hashable, Any] = {}  # replica group -> the served-draft digests after its load
        self.refusals: dict[str, int] = {}  # drafter/publish_{rejected,failed,stale}_total, republished
        self.sync_metrics: dict[str, float] = {}  # metrics of weight syncs, handed over by consume_sync_metrics

    # ------------------------------------------------------------------ the step

    @property
    def in_flight(self) -> bool:
        return self._round is not None

    def end_step(self, step: int, last: bool, rows: list[Any], head: Any,
                 counters: SpecCounters | None = None) -> dict[str, float]:
        """The step boundary: this step's acceptance (`counters`, None without servers), last step's round
        collected, the rows added, and a round unless `fresh_samples` runs it later."""
        out = self.acceptance(counters)
        out.update(self.collect())
        out.update(self.add(rows, head, "drafter"))
        if not self.cfg.fresh_samples:
            out.update(self.maybe_train(step, last))
        return out

    def add(self, rows: list[Any], head: Any, prefix: str = "drafter") -> dict[str, float]:
        """Hand rows to the drafter; the link's answer as `prefix/<key>` metrics."""
        if not rows:
            return {}
        if head is None:
            raise RuntimeError("drafter capture: rows without a target-head snapshot (rank 0 captured nothing)")
        return {f"{prefix}/{k}": float(v) for k, v in self.link.add(rows, head).items()}

    def maybe_train(self, step: int, last: bool) -> dict[str, float]:
        """A round every `train_interval` steps (`serial`, or the last step: collected now; `overlap`:
        collected by the next `collect`), published every `publish_interval` rounds."""
        if step % self.cfg.train_interval != 0:
            return {}
        if self._round is not None:
            raise RuntimeError("OnlineController.maybe_train: a round is still in flight; collect() it first")
        if self.link.next_round_steps() <= 0:
            if "empty" not in self._warned:
                self._warned.add("empty")
                print("verl_speco: no rows captured since the previous drafter round; skipping this round")
            return {}
        self._round = self.link.start_round()
        self._round_started = time.perf_counter()
        if self.cfg.schedule == "serial" or last:
            return self.collect()
        return {}

    def collect(self, publish: bool = True) -> dict[str, float]:
        """Wait for the round in flight (none: {}), count it, publish every `publish_interval` rounds
        (`publish=False`: never, e.g. a study measuring the draft itself afterwards)."""
        if self._round is None:
            return {}
        waited = time.perf_counter()
        handle, self._round = self._round, None
        result = self.link.wait_round(handle)
        now = time.perf_counter()
        self.last_round = dict(result)
        out = {f"drafter/{k}": float(v) for k, v in result.items()}
        out["drafter/train_wait_seconds"] = now - waited
        out["drafter/train_wall_seconds"] = now - self._round_started
        self.rounds += 1
        if publish and self.rounds % self.cfg.publish_interval == 0:
            out.update(self.publish())
        return out

    def publish(self) -> dict[str, float]:
        """Publish now; the rollout servers load it at their next weight sync (`to_load`)."""
        if self._round is not None:
            raise RuntimeError("OnlineController.publish: a round is in flight; collect() it first")
        pub = self.link.publish()
        self.latest = pub
        return {"drafter/version": float(pub["version"]), "drafter/publish_seconds": float(pub["seconds"]),
                "drafter/publish_bytes": float(pub["bytes"])}

    # ---------------------------------------------------------- acceptance

    def acceptance(self, now: SpecCounters | None) -> dict[str, float]:
        """The rollout window's acceptance: `now` (cumulative, summed over replicas) minus the counters
        at the previous step (`drafter/accept/*`); {} without servers."""
        if now is None:
            return {}
        previous, self.counters = self.counters, now
        return acceptance_metrics(now - previous, "drafter/accept")

    def count_aside(self, before: SpecCounters | None, after: SpecCounters | None, prefix: str) -> dict[str, float]:
        """A window that is not rollout (validation, fresh samples): its acceptance as `prefix/*`, and
        its drafts kept out of the next step's `drafter/accept/*`."""
        if before is None or after is None:
            return {}
        self.counters = self.counters + (after - before)
        return acceptance_metrics(after - before, prefix)

    # ------------------------------------------------- publish bookkeeping

    def held(self, group: Hashable) -> int:
        """The version replica group `group` loaded last (-1: none)."""
        return self.loaded.get(group, -1)

    def to_load(self, group: Hashable) -> dict[str, Any] | None:
        """The newest publish `group` neither holds nor refused, else None."""
        pub = self.latest
        if pub is not None and int(pub["version"]) > max(self.held(group), self.refused.get(group, -1)):
            return pub
        return None

    def record_load(self, group: Hashable, version: int, status: str, reasons: list[str], digests: Any,
                    seconds: float) -> None:
        """The servers' answer to loading `version`: "loaded" (with the digests they then serve) or a
        refusal (counted; they keep serving what they held and the version is not offered again)."""
        if status == "loaded":
            self.loaded[group] = int(version)
            self.digests[group] = digests
            self.sync_metrics["drafter/publish_load_seconds"] = seconds
            return
        held = self.held(group)
        self.refused[group] = int(version)
        key = f"drafter/publish_{status}_total"
        self.refusals[key] = self.refusals.get(key, 0) + 1
        logger.warning("drafter publish v%s not loaded by the rollout servers (%s): %s; they keep serving v%s",
                       version, status, "; ".join(reasons), held)

    def record_served(self, versions: list[Any]) -> None:
        """The versions the engine workers serve after a sync, and the refusal counts so far."""
        if versions:
            self.sync_metrics["drafter/served_version_min"] = float(min(int(v) for v in versions))
        self.sync_metrics.update({k: float(v) for k, v in self.refusals.items()})

    def consume_sync_metrics(self) -> dict[str, float]:
        out, self.sync_metrics = self.sync_metrics, {}
        return out
