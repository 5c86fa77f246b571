"""`SpecoTrainerMixin`: verl's v1 PPO trainers with online drafter co-training, a thin adapter from verl's
hooks to the `OnlineController` and `trainer_setup` / `trainer_step` / `weight_sync`. `VERL_PATCHES` lists
the private verl methods overridden, read on `VERL_RELEASES`; other installed releases are refused."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import ray
import verl
from verl.trainer.ppo.utils import Role

from verl_speco.online.config import DrafterConfigError, DrafterRunConfig
from verl_speco.online.controller import OnlineController, capture_step
from verl_speco.verl_integration import trainer_setup, trainer_step
from verl_speco.verl_integration.sglang_agent_loop import VERL_RELEASES
from verl_speco.verl_integration.worker import (
    POLICY_VERSION_KEY,
    POST_UPDATE_VERSION_KEY,
    SpecoActorRolloutRefWorker,
)

ACTOR_ROLES = (Role.Actor, Role.ActorRollout, Role.ActorRolloutRef)
VERL_PATCHES = {  # verl's private PPOTrainer methods overridden below -> what the override adds
    "_init_resource_pool_mgr": "the actor role runs SpecoActorRolloutRefWorker (capture hooks)",
    "_setup": "drafter group, speculative config and replica class before; capture, publish v1 after",
    "_compute_old_log_prob": "tags a capture step's batch with the policy version (old_logprob capture)",
    "_update_actor": "tags a capture step's batch with the updated version (post_update capture)",
    "_consume_sync_metrics": "adds the weight syncs' drafter/ metrics (draft loads, refusals)",
    "_validate": "adds drafter/heldout/* (and drafter/heldout_baseline/*) from the servers' counters",
}


def require_verl_release(version: str) -> None:
    if version not in VERL_RELEASES:
        raise DrafterConfigError(f"verl {version} is installed; SpecoTrainerMixin overrides verl's private trainer "
                                 f"methods {sorted(VERL_PATCHES)}, read on verl {list(VERL_RELEASES)} only")


class SpecoTrainerMixin:
    """Mixed in front of a verl v1 `PPOTrainer` subclass (see the module docstring)."""

    config: Any
    global_steps: int
    total_training_steps: int
    role_worker_mapping: dict[Any, Any]
    actor_rollout_wg: Any
    # set by `_setup` when in use (class defaults: a trainer built without them behaves as before)
    speco_ctl: OnlineController | None = None  # online: the schedule, rounds, publishes and metrics
    _speco_rollout: Any = None  # a RolloutCapture when capture_source resolved to the rollout
    _speco_sink: Any = None  # collect_only from the rollout: the driver writes the store
    _speco_pending: tuple[Any, Any] | None = None  # this step's rollout rows and head snapshot
    _speco_baseline: tuple[str, int] | None = None  # (path, version) of the kept initial draft
    _speco_fresh: Any = None  # FreshPrompts when drafter.fresh_samples > 0 (online)

    def __init__(self, config: Any, drafter: DrafterRunConfig):
        """`drafter`: the run's drafter section, parsed once in this process (`config_bridge`)."""
        self.speco = drafter
        super().__init__(config)  # type: ignore[call-arg]
        trainer_setup.check_trainer_config(config, drafter)

    @property
    def speco_active(self) -> bool:
        return bool(self.speco.enable) and self.speco.mode != "offline"

    @property
    def speco_online(self) -> bool:
        return self.speco_active and self.speco.mode == "online"

    def _speco_super(self, name: str) -> Callable[..., Any]:
        """verl's `name` on this trainer (the next class after the mixin)."""
        method: Callable[..., Any] = getattr(super(), name)
        return method

    # ------------------------------------------------------------------ setup

    def _init_resource_pool_mgr(self) -> None:
        self._speco_super("_init_resource_pool_mgr")()
        if not self.speco_active:
            return
        for role in ACTOR_ROLES:
            if role in self.role_worker_mapping:
                self.role_worker_mapping[role] = ray.remote(SpecoActorRolloutRefWorker)

    def _setup(self) -> None:
        if not self.speco_active:
            self._speco_super("_setup")()
            return
        layer_ids, shape = trainer_setup.before_verl_setup(self)
        self._speco_super("_setup")()
        trainer_setup.after_verl_setup(self, layer_ids, shape)

    # ------------------------------------------------------------- the step

    def _speco_captures(self, capture_pass: str) -> bool:
        return (self._speco_rollout is None and self.speco.capture_pass == capture_pass
                and self._speco_capture_step())

    def _speco_capture_step(self) -> bool:
        return self.speco_active and capture_step(self.speco, self.global_steps)

    def _compute_old_log_prob(self, batch: Any, metrics: dict) -> Any:
        if self._speco_rollout is not None and self._speco_capture_step():
            trainer_step.take_rollout_rows(self, batch)
        if self._speco_captures("old_logprob"):  # rows of the policy that generated this step's rollout
            batch.extra_info[POLICY_VERSION_KEY] = self.global_steps - 1
        try:
            return self._speco_super("_compute_old_log_prob")(batch, metrics)
        finally:
            batch.extra_info.pop(POLICY_VERSION_KEY, None)

    def _update_actor(self, batch: Any, metrics: dict) -> Any:
        if self._speco_captures("post_update"):  # rows of the updated policy (the next rollout's)
            batch.extra_info[POST_UPDATE_VERSION_KEY] = self.global_steps
        try:
            return self._speco_super("_update_actor")(batch, metrics)
        finally:
            batch.extra_info.pop(POST_UPDATE_VERSION_KEY, None)

    def step(self, metrics: dict, timing_raw: dict) -> Any:
        batch = self._speco_super("step")(metrics, timing_raw)
        if self.speco_active:
            started = time.perf_counter()
            metrics.update(trainer_step.after_step(self))
            timing_raw["drafter"] = time.perf_counter() - started
        return batch

    def on_step_end(self) -> None:
        self._speco_super("on_step_end")()  # the weight sync: the servers run the updated policy
        if self.speco_ctl is not None and self.speco.fresh_samples:
            self.speco_ctl.sync_metrics.update(trainer_step.fresh_round(self))

    def _consume_sync_metrics(self) -> dict:
        out = dict(self._speco_super("_consume_sync_metrics")())
        if self.speco_ctl is not None:
            out.update(self.speco_ctl.consume_sync_metrics())
        return out

    def _validate(self) -> dict[str, float]:
        return trainer_step.validate(self, self._speco_super("_validate"))


_CLASSES: dict[type, type] = {}


def speco_trainer_cls(base: type) -> type:
    """`Speco<Base>`: the mixin in front of verl trainer class `base` (one class per base); refuses a verl
    release other than `VERL_RELEASES` (`VERL_PATCHES` were read on those)."""
    require_verl_release(verl.__version__)
    if base not in _CLASSES:
        _CLASSES[base] = type(f"Speco{base.__name__}", (SpecoTrainerMixin, base), {"__module__": __name__})
    return _CLASSES[base]
