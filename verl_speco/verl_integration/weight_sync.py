"""The rollout servers' side of a publish in a verl run: verl's weight sync restores only the target and
its level-2 sleep discards the draft, so `SpecoCheckpointEngineManager` runs `after_weights` after every
sync and wake-up (nothing in flight): load the newest publish, else check by digest and re-publish."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

from verl.checkpoint_engine.base import CheckpointEngineManager
from verl.utils.ray_utils import auto_await

from verl_speco.engines.spec_metrics import SpecCounters
from verl_speco.online.controller import OnlineController
from verl_speco.online.publish import load_outcome

MANAGER_ATTRS = ("checkpoint_manager", "standalone_checkpoint_manager")  # separate_async: standalone replicas too


class SpecoCheckpointEngineManager(CheckpointEngineManager):
    """verl 0.9.1's checkpoint manager that runs `after_weights` after every weight sync and wake-up,
    always while no request is in flight."""

    def __init__(self, config: Any, actor_wg: Any, replicas: list[Any],
                 after_weights: Callable[[CheckpointEngineManager], Awaitable[None]]):
        super().__init__(config=config, actor_wg=actor_wg, replicas=replicas)
        self._after_weights = after_weights

    @classmethod
    def wrap(cls, manager: CheckpointEngineManager,
             after_weights: Callable[[CheckpointEngineManager], Awaitable[None]]) -> SpecoCheckpointEngineManager:
        return cls(manager.config, manager.actor_wg, manager.replicas, after_weights)

    @auto_await
    async def update_weights(self, global_steps: int | None = None) -> Any:
        result = await CheckpointEngineManager.update_weights.__wrapped__(self, global_steps)  # type: ignore[attr-defined]
        if self.backend == "naive":  # colocated: the actor's sync woke the servers; no request is in flight
            await self._after_weights(self)
        return result  # other backends: done in resume_generation_replicas, before generation resumes

    @auto_await
    async def resume_generation_replicas(self) -> None:
        """verl aborts generation around a non-naive weight sync (and its async trainers around their own
        pauses) and resumes it here: the draft is loaded while nothing is in flight, then generation resumes."""
        await self._after_weights(self)
        await CheckpointEngineManager.resume_generation_replicas.__wrapped__(self)  # type: ignore[attr-defined]

    @auto_await
    async def wake_up_replicas(self) -> None:
        await CheckpointEngineManager.wake_up_replicas.__wrapped__(self)  # type: ignore[attr-defined]
        await self._after_weights(self)


def wrap_managers(trainer: Any, controller: OnlineController) -> None:
    """Put `SpecoCheckpointEngineManager` in place of each of the trainer's checkpoint managers."""
    for attr in MANAGER_ATTRS:
        manager = getattr(trainer, attr, None)
        if isinstance(manager, CheckpointEngineManager):
            setattr(trainer, attr, SpecoCheckpointEngineManager.wrap(manager, weights_hook(controller)))


def weights_hook(controller: OnlineController) -> Callable[[CheckpointEngineManager], Awaitable[None]]:
    async def hook(manager: CheckpointEngineManager) -> None:
        await after_weights(controller, manager)
    return hook


async def after_weights(controller: OnlineController, manager: CheckpointEngineManager) -> None:
    """After verl restored the target weights: load the newest publish the replicas do not hold, else check
    by digest that they still serve theirs and re-publish it if lost (`served_draft.check_served_draft`)."""
    from verl_speco.verl_integration.served_draft import check_served_draft, record

    started = time.perf_counter()
    replicas, group = list(manager.replicas), id(manager)

    def call(method: str) -> Awaitable[list[Any]]:
        return replica_call(replicas, method)
    pub = controller.to_load(group)
    if pub is not None:
        version = int(pub["version"])
        status, reasons = load_outcome(await replica_call(replicas, "speco_load_draft", (pub["path"], version)))
        digests = await record(call) if status == "loaded" else None
        controller.record_load(group, version, status, reasons, digests, time.perf_counter() - started)
    elif controller.held(group) >= 0:
        if await check_served_draft(call, controller.digests.get(group), controller.refusals) != "intact":
            controller.sync_metrics["drafter/reapply_seconds"] = time.perf_counter() - started
    controller.record_served(await replica_call(replicas, "speco_draft_version"))


async def replica_call(replicas: list[Any], method: str, args: tuple = ()) -> list[Any]:
    """`method(*args)` on every engine worker of every replica: their answers, in a fixed order."""
    answers = await asyncio.gather(*[r.speco_call(method, args) for r in replicas])
    return [a for per in answers for a in per]


@auto_await
async def call_replicas(replicas: list[Any], method: str, args: tuple = ()) -> list[Any]:
    return await replica_call(replicas, method, args)


def replicas_of(trainer: Any) -> list[Any]:
    return list(getattr(getattr(trainer, "checkpoint_manager", None), "replicas", []) or [])


def read_counters(trainer: Any) -> SpecCounters | None:
    """The rollout servers' cumulative spec-decode counters, summed over replicas (None: no replicas)."""
    replicas = replicas_of(trainer)
    if not replicas:
        return None
    now = SpecCounters()
    for counters in _gather_counters(replicas):
        now = now + counters
    return now


@auto_await
async def _gather_counters(replicas: list[Any]) -> list[SpecCounters]:
    return list(await asyncio.gather(*[r.speco_spec_counters() for r in replicas]))
