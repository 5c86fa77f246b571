"""`SpecoTrainerMixin`: verl's v1 PPO trainers with online drafter co-training.

`speco_trainer_cls(base)` returns `Speco<Base>(SpecoTrainerMixin, base)` for any trainer in verl's
registry (`verl.trainer.ppo.v1.get_trainer_cls(trainer.v1.trainer_mode)`). With the drafter
disabled (or in `offline` mode) every override falls through to verl. Otherwise:

- `_init_resource_pool_mgr`: the actor role runs `SpecoActorRolloutRefWorker` (capture hooks).
- `_setup`: online, starts the drafter worker group, asks it for the layer ids, points the rollout
  engine's speculative config at the initial draft (`drafter.model_path`, else a fresh export) and
  installs our vLLM or SGLang replica class in verl's registry; after verl's setup, arms the workers' capture
  and wraps the checkpoint manager so the latest draft is loaded after every weight sync and wake-up,
  and the held one checked by digest and re-published when lost (verl's level-2 sleep discards
  draft weights and its weight sync only restores the target: `served_draft.py`).
- `_compute_old_log_prob`: on capture steps (`collect_interval`) tags the batch with the policy
  version (`global_steps - 1` actor updates so far), which turns the workers' hooks on;
  `_update_actor` does the same with version `global_steps` under `capture_pass=post_update` (the
  workers then run one forward of the updated actor after the update).
- `step`: after verl's step, flushes the workers' rows (`speco_end_step`) to the drafter group
  (online) or the Feature Store (collect_only), runs a training round every `train_interval` steps
  (`schedule=serial`: now; `overlap`: started now, collected at the next step's boundary, so it runs
  during the next rollout) and publishes every `publish_interval` rounds. The publish reaches the
  rollout servers at the next weight sync (they sleep during the actor update).
- metrics under `drafter/` are merged into verl's step metrics, so verl's `Tracking` logs them;
  `drafter/accept/*` is the step's rollout acceptance, `drafter/heldout/*` the acceptance on verl's
  validation (`trainer.test_freq`; held-out `data.val_files`, greedy by default), both from the
  rollout servers' own spec-decode counters.
"""

from __future__ import annotations

import asyncio
import logging
import tempfile
import time
from collections.abc import Awaitable, Callable
from typing import Any

import ray
from omegaconf import open_dict
from verl.checkpoint_engine.base import CheckpointEngineManager
from verl.trainer.ppo.utils import Role
from verl.utils.ray_utils import auto_await

from drafters.registry import engine_format_from_dict
from verl_speco.engines.spec_metrics import SpecCounters, acceptance_summary
from verl_speco.online.config import DrafterConfigError, DrafterRunConfig
from verl_speco.online.publish import load_outcome, publish_dir_of
from verl_speco.online.publish_room import require_publish_room
from verl_speco.verl_integration.config_bridge import (
    apply_speculative_config,
    extract_drafter,
    rollout_engine,
)
from verl_speco.verl_integration.trainer_setup import (
    installed,
    keep_baseline,
    local_layout,
    speco_capture_source,
)
from verl_speco.verl_integration.worker import (
    COUNT_KEYS,
    POLICY_VERSION_KEY,
    POST_UPDATE_VERSION_KEY,
    SpecoActorRolloutRefWorker,
)

ACTOR_ROLES = (Role.Actor, Role.ActorRollout, Role.ActorRolloutRef)
logger = logging.getLogger(__name__)


class SpecoCheckpointEngineManager(CheckpointEngineManager):
    """verl's checkpoint manager that runs `after_weights` after every weight sync and wake-up, always
    while no request is in flight (naive backend: after the sync; other backends: between the sync and
    `resume_generation_replicas`)."""

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


def _sum_counts(results: list[dict[str, Any]]) -> dict[str, int]:
    total = dict.fromkeys(COUNT_KEYS, 0)
    for r in results:
        for k in COUNT_KEYS:
            total[k] += int(r.get("counts", {}).get(k, 0))
    return total


def _rows_and_head(results: list[dict[str, Any]]) -> tuple[list[Any], Any]:
    """The workers' `speco_end_step` results -> (every rank's row refs, the first target-head snapshot or None)."""
    heads = [r["head"] for r in results if r.get("head") is not None]
    return [ref for r in results for ref in r.get("rows", [])], heads[0] if heads else None


class SpecoTrainerMixin:
    """Mixed in front of a verl v1 `PPOTrainer` subclass (see the module docstring)."""

    config: Any
    global_steps: int
    total_training_steps: int
    role_worker_mapping: dict[Any, Any]
    actor_rollout_wg: Any
    agent_loop_manager: Any
    _balance_batch: Callable[..., Any]
    replay_buffer: Any
    train_dataset: Any
    checkpoint_manager: Any
    llm_server_manager: Any
    # set by `_setup` when in use (class defaults: a trainer built without them behaves as before)
    _speco_rollout: Any = None  # a RolloutCapture when capture_source resolved to the rollout
    _speco_sink: Any = None  # collect_only from the rollout: the driver writes the store
    _speco_pending: tuple[Any, Any] | None = None  # this step's rollout rows and head snapshot
    _speco_baseline: tuple[str, int] | None = None  # (path, version) of the kept initial draft
    _speco_fresh: Any = None  # FreshPrompts when drafter.fresh_samples > 0 (online)

    def __init__(self, config: Any):
        self.speco: DrafterRunConfig = extract_drafter(config)
        super().__init__(config)  # type: ignore[call-arg]
        self._speco_drafter: Any = None
        self._speco_round_ref: Any = None  # an overlapped training round in flight
        self._speco_round_started = 0.0
        self._speco_rounds = 0
        self._speco_latest: dict[str, Any] | None = None  # the newest publish {"version", "path", ...}
        self._speco_loaded: dict[int, int] = {}  # id(checkpoint manager) -> version its replicas hold
        self._speco_refused: dict[int, int] = {}  # id(checkpoint manager) -> newest version they refused
        self._speco_refusals: dict[str, int] = {}  # drafter/publish_{rejected,failed,stale}_total, republished
        self._speco_digests: dict[int, Any] = {}  # id(checkpoint manager) -> served-draft digests after its load
        self._speco_sync_metrics: dict[str, float] = {}
        self._speco_warned: set[str] = set()
        self._speco_counters = SpecCounters()  # the rollout servers' cumulative counters at the last step
        if self.speco_active and self.speco.capture_pass == "old_logprob":
            rc = config.algorithm.get("rollout_correction", None)
            if rc is not None and rc.get("bypass_mode", False):
                raise DrafterConfigError("algorithm.rollout_correction.bypass_mode: got True, expected False with "
                                         "actor_rollout_ref.rollout.drafter.capture_pass=old_logprob (capture "
                                         "runs in the old-logprob pass, which bypass mode skips; "
                                         "capture_pass=post_update works with it)")
        if self.speco_online:
            from verl_speco.verl_integration.fresh_samples import check_trainer_mode

            check_trainer_mode(self.speco, str(config.trainer.v1.trainer_mode))

    @property
    def speco_active(self) -> bool:
        return bool(self.speco.enable) and self.speco.mode != "offline"

    @property
    def speco_online(self) -> bool:
        return self.speco_active and self.speco.mode == "online"

    # ------------------------------------------------------------------ setup

    def _init_resource_pool_mgr(self) -> None:
        super()._init_resource_pool_mgr()  # type: ignore[misc]
        if not self.speco_active:
            return
        for role in ACTOR_ROLES:
            if role in self.role_worker_mapping:
                self.role_worker_mapping[role] = ray.remote(SpecoActorRolloutRefWorker)

    def _speco_target_dir(self) -> str:
        from verl.utils.fs import copy_to_local

        model = self.config.actor_rollout_ref.model
        return str(copy_to_local(str(model.path), use_shm=bool(model.get("use_shm", False))))

    def _setup(self) -> None:
        if not self.speco_active:
            super()._setup()  # type: ignore[misc]
            return
        target_dir = self._speco_target_dir()
        engine = rollout_engine(self.config)
        plan = speco_capture_source(self.speco, engine, target_dir, installed("sglang"))
        if plan is not None:
            from drafters.common.target import TargetSpec
            from verl_speco.verl_integration.rollout_rows import arm_rollout_capture

            hidden = int(TargetSpec.from_pretrained(target_dir).hidden_size)
            self._speco_rollout = arm_rollout_capture(self.config, self.speco, plan, hidden)
        if self.speco_online:
            from verl_speco.deploy.engine_check import require_engine_support
            from verl_speco.verl_integration.drafter_actor import start_drafter_group

            # before anything starts: an engine release that cannot serve the family, or (vLLM) one
            # the live draft reload was not checked against, is refused naming the release and why
            require_engine_support(engine, self.speco.family, live_publish=True)
            if self.speco.heldout_baseline and engine != "vllm":
                raise DrafterConfigError(f"actor_rollout_ref.rollout.drafter.heldout_baseline: got True with "
                                         f"rollout.name={engine}, expected rollout.name=vllm (SGLang reports no "
                                         "acceptance counters to compare the drafts with)")
            run_name = str(self.config.trainer.experiment_name)
            device_type = "npu" if str(self.config.trainer.get("device", "cuda")) == "npu" else "cuda"
            self._speco_drafter = start_drafter_group(self.speco, target_dir, run_name, device_type)
            layer_ids = ray.get(self._speco_drafter.layer_ids.remote())
            shape = ray.get(self._speco_drafter.target_shape.remote())
            draft_dir = self.speco.model_path
            if not draft_dir:
                out = tempfile.mkdtemp(prefix="verl_speco_initial_draft_")
                draft_dir = ray.get(self._speco_drafter.export_initial.remote(out))
            # before the engines start: room for the versions the run will publish (/dev/shm in a container)
            require_publish_room(publish_dir_of(self.speco.publish_dir, run_name), draft_dir)
            fmt = engine_format_from_dict(ray.get(self._speco_drafter.engine_format.remote()))
            apply_speculative_config(self.config, self.speco, str(draft_dir), fmt)
            if engine == "vllm":
                from verl_speco.verl_integration.vllm_server import install_replica_class

                install_replica_class()
                with open_dict(self.config.actor_rollout_ref.rollout):  # the acceptance counters need stats
                    self.config.actor_rollout_ref.rollout.disable_log_stats = False
            else:  # sglang (rollout_engine admits only ENGINES)
                from verl_speco.verl_integration.draft_servers import install_sglang_replica_class

                install_sglang_replica_class()
        else:
            layer_ids, shape = local_layout(self.speco, target_dir)
        super()._setup()  # type: ignore[misc]
        if self._speco_rollout is None:  # the workers capture
            self.actor_rollout_wg.speco_init(layer_ids, shape["hidden_size"], shape["vocab_size"],
                                             str(self.config.actor_rollout_ref.model.path))
        elif not self.speco_online:  # the rollout's rows go to the store from here
            from verl_speco.verl_integration.rollout_rows import rollout_store_sink

            self._speco_sink = rollout_store_sink(self.speco, self._speco_rollout.plan, shape["hidden_size"],
                                                  shape["vocab_size"], str(self.config.actor_rollout_ref.model.path))
        if self.speco_online:
            # verl's trainers sync the colocated replicas through `checkpoint_manager`; the
            # separate_async trainer also has standalone replicas behind `standalone_checkpoint_manager`
            for attr in ("checkpoint_manager", "standalone_checkpoint_manager"):
                manager = getattr(self, attr, None)
                if isinstance(manager, CheckpointEngineManager):
                    setattr(self, attr, SpecoCheckpointEngineManager.wrap(manager, self._speco_after_weights))
            # v1 = the initial draft: loaded by on_init_end's weight sync, so re-apply always has a source
            self._speco_publish_now()
            if self.speco.fresh_samples:
                from verl_speco.verl_integration.fresh_samples import FreshPrompts

                self._speco_fresh = FreshPrompts(self.train_dataset, self.speco.fresh_samples, self.speco.seed)
            if self.speco.heldout_baseline and self._speco_latest is not None:
                self._speco_baseline = keep_baseline(str(self._speco_latest["path"]))

    # ----------------------------------------------------------- weight sync

    @staticmethod
    async def _speco_replica_call(replicas: list[Any], method: str, args: tuple = ()) -> list[Any]:
        answers = await asyncio.gather(*[r.speco_call(method, args) for r in replicas])
        return [a for per in answers for a in per]

    async def _speco_after_weights(self, manager: CheckpointEngineManager) -> None:
        """After verl restored the target weights of `manager`'s replicas: load the newest publish
        they do not hold yet (and record the digest each worker then serves), else check that they
        still serve the one they hold and re-publish it when a level-2 sleep discarded it
        (`served_draft.check_served_draft`)."""
        from verl_speco.verl_integration.served_draft import check_served_draft, record

        started = time.perf_counter()
        replicas = list(manager.replicas)

        def call(method: str) -> Awaitable[list[Any]]:
            return self._speco_replica_call(replicas, method)
        held = self._speco_loaded.get(id(manager), -1)
        pub = self._speco_latest
        refused = self._speco_refused.get(id(manager), -1)
        if pub is not None and int(pub["version"]) > max(held, refused):
            answers = await self._speco_replica_call(replicas, "speco_load_draft", (pub["path"], int(pub["version"])))
            status, reasons = load_outcome(answers)
            if status == "loaded":
                self._speco_loaded[id(manager)] = int(pub["version"])
                self._speco_digests[id(manager)] = await record(call)
                self._speco_sync_metrics["drafter/publish_load_seconds"] = time.perf_counter() - started
            else:  # the servers keep serving the draft they held; this version is not offered again
                self._speco_refused[id(manager)] = int(pub["version"])
                key = f"drafter/publish_{status}_total"
                self._speco_refusals[key] = self._speco_refusals.get(key, 0) + 1
                logger.warning("drafter publish v%s not loaded by the rollout servers (%s): %s; they keep "
                               "serving v%s", pub["version"], status, "; ".join(reasons), held)
        elif held >= 0:
            if await check_served_draft(call, self._speco_digests.get(id(manager)), self._speco_refusals) != "intact":
                self._speco_sync_metrics["drafter/reapply_seconds"] = time.perf_counter() - started
        versions = await self._speco_replica_call(replicas, "speco_draft_version")
        if versions:
            self._speco_sync_metrics["drafter/served_version_min"] = float(min(int(v) for v in versions))
        self._speco_sync_metrics.update({k: float(v) for k, v in self._speco_refusals.items()})

    # ------------------------------------------------------------- the step

    def _speco_capture_step(self) -> bool:
        return self.speco_active and (self.global_steps - 1) % self.speco.collect_interval == 0

    def _speco_captures(self, capture_pass: str) -> bool:
        return self._speco_rollout is None and self.speco.capture_pass == capture_pass and self._speco_capture_step()

    def _compute_old_log_prob(self, batch: Any, metrics: dict) -> Any:
        if self._speco_rollout is not None and self._speco_capture_step():
            self._speco_take_rollout_rows(batch)
        if self._speco_captures("old_logprob"):  # rows of the policy that generated this step's rollout
            batch.extra_info[POLICY_VERSION_KEY] = self.global_steps - 1
        try:
            return super()._compute_old_log_prob(batch, metrics)  # type: ignore[misc]
        finally:
            batch.extra_info.pop(POLICY_VERSION_KEY, None)

    def _speco_take_rollout_rows(self, batch: Any) -> None:
        """This step's rows from the rollout's returned hidden states (before the update: the rows and the
        head snapshot are of the policy that generated them)."""
        import transfer_queue as tq

        from verl_speco.verl_integration.rollout_rows import read_rollout_entries

        version = self.global_steps - 1
        rows = self._speco_rollout.rows_from_encoded(read_rollout_entries(batch, tq.kv_batch_get), version)
        head = None
        if self.speco_online:
            heads = [h for h in self.actor_rollout_wg.speco_snapshot_head(version) if h is not None]
            head = heads[0] if heads else None
        self._speco_pending = (rows, head)

    def _update_actor(self, batch: Any, metrics: dict) -> Any:
        if self._speco_captures("post_update"):  # rows of the updated policy (the next rollout's)
            batch.extra_info[POST_UPDATE_VERSION_KEY] = self.global_steps
        try:
            return super()._update_actor(batch, metrics)  # type: ignore[misc]
        finally:
            batch.extra_info.pop(POST_UPDATE_VERSION_KEY, None)

    def step(self, metrics: dict, timing_raw: dict) -> Any:
        batch = super().step(metrics, timing_raw)  # type: ignore[misc]
        if self.speco_active:
            started = time.perf_counter()
            metrics.update(self._speco_after_step())
            timing_raw["drafter"] = time.perf_counter() - started
        return batch

    def on_step_end(self) -> None:
        super().on_step_end()  # type: ignore[misc]  # the weight sync: the servers run the updated policy
        if self.speco_online and self.speco.fresh_samples:
            self._speco_sync_metrics.update(self._speco_fresh_round())

    def _speco_fresh_round(self) -> dict[str, float]:
        """`drafter.fresh_samples` (`verl_integration.fresh_samples`): one response of the updated policy to
        each of that many training prompts, captured by the updated actor and added to the step's rows; then
        the round, the publish, and a weight sync that hands the servers the new draft."""
        import transfer_queue as tq

        started = time.perf_counter()
        count, steps = self.speco.fresh_samples, self.global_steps
        prompts = self._speco_fresh.next_batch(steps)
        tags = [{"is_prompt": True, "status": "pending", "global_steps": steps} for _ in range(count)]
        before = self._speco_read_counters()
        tq.kv_batch_put(keys=list(prompts["uid"]), partition_id="train", tags=tags)
        self.agent_loop_manager.generate_sequences(prompts)
        batch, _ = self.replay_buffer.sample(global_steps=steps, partition_id="train", batch_size=count)
        after = self._speco_read_counters()
        out: dict[str, float] = {"drafter/fresh/generate_seconds": time.perf_counter() - started}
        if before is not None and after is not None:
            self._speco_counters = self._speco_counters + (after - before)  # not counted as rollout
            out.update(_acceptance_metrics(after - before, "drafter/fresh"))
        self.checkpoint_manager.sleep_replicas()  # as before verl's own actor passes
        try:
            batch = self._balance_batch(batch, metrics={})
            batch.extra_info.update({"calculate_entropy": True, "compute_loss": False,
                                     "temperature": self.config.actor_rollout_ref.rollout.temperature,
                                     POLICY_VERSION_KEY: steps})  # rows of the updated policy, version `steps`
            self.actor_rollout_wg.compute_log_prob(batch)
        finally:
            tq.kv_clear(keys=batch.keys, partition_id=batch.partition_id)
        results = self.actor_rollout_wg.speco_end_step(steps)
        out.update({f"drafter/fresh/capture/{k}": float(v) for k, v in _sum_counts(results).items()})
        out.update(self._speco_add_rows(*_rows_and_head(results), "drafter/fresh"))
        out.update(self._speco_maybe_train())
        self.checkpoint_manager.update_weights(steps)  # wakes the servers; `_speco_after_weights` loads the draft
        out["drafter/fresh/seconds"] = time.perf_counter() - started
        return out

    def _consume_sync_metrics(self) -> dict:
        out = dict(super()._consume_sync_metrics())  # type: ignore[misc]
        out.update(self._speco_sync_metrics)
        self._speco_sync_metrics = {}
        return out

    def _speco_after_step(self) -> dict[str, float]:
        out: dict[str, float] = {}
        if self._speco_rollout is not None:
            return self._speco_after_rollout_step()
        results = self.actor_rollout_wg.speco_end_step(self.global_steps)
        counts = _sum_counts(results)
        out.update({f"drafter/capture/{k}": float(v) for k, v in counts.items()})
        out["drafter/capture/seconds_max"] = max((float(r.get("capture_seconds", 0.0)) for r in results), default=0.0)
        if not self.speco_online:
            out["drafter/store/seconds_max"] = max((float(r.get("store_seconds", 0.0)) for r in results), default=0.0)
            out["drafter/store/samples"] = float(sum(int(r.get("store_samples", 0)) for r in results))
            return out
        return {**out, **self._speco_online_round(*_rows_and_head(results))}

    def _speco_after_rollout_step(self) -> dict[str, float]:
        """`_speco_after_step` when the rows came from the rollout (`_speco_take_rollout_rows`)."""
        from verl_speco.online.rollout_capture import capture_metrics

        pending, self._speco_pending = self._speco_pending, None
        out: dict[str, float] = {}
        refs: list[Any] = []
        head = None
        if pending is not None:
            rows, head = pending
            out.update(capture_metrics(rows))
            if self._speco_sink is not None:
                started = time.perf_counter()
                self._speco_sink.write(rows, self.global_steps)
                self._speco_sink.end_step(self.global_steps)
                out["drafter/store/seconds_max"] = time.perf_counter() - started
                out["drafter/store/samples"] = float(self._speco_sink.samples)
                if self.global_steps >= self.total_training_steps:
                    self._speco_sink.close()
                    self._speco_sink = None
            elif rows.records:
                refs = [ray.put(rows.to_bytes())]
        if not self.speco_online:
            return out
        return {**out, **self._speco_online_round(refs, head)}

    def _speco_online_round(self, rows: list[Any], head: Any) -> dict[str, float]:
        """Hand this step's rows (object refs of `CapturedRows.to_bytes`) to the drafter group, train
        every `train_interval` steps, publish every `publish_interval` rounds."""
        out: dict[str, float] = {}
        out.update(self._speco_acceptance())
        if self._speco_round_ref is not None:  # an overlapped round started last step
            out.update(self._speco_finish_round())
        out.update(self._speco_add_rows(rows, head, "drafter"))
        if not self.speco.fresh_samples:  # else the round runs after the fresh samples (`on_step_end`)
            out.update(self._speco_maybe_train())
        return out

    def _speco_add_rows(self, rows: list[Any], head: Any, prefix: str) -> dict[str, float]:
        if not rows:
            return {}
        if head is None:
            raise RuntimeError("drafter capture: rows without a target-head snapshot (rank 0 captured nothing)")
        add = ray.get(self._speco_drafter.add.remote(rows, head))
        return {f"{prefix}/{k}": float(v) for k, v in add.items()}

    def _speco_maybe_train(self) -> dict[str, float]:
        """A training round every `train_interval` steps (`schedule=serial`, or the last step: waited for
        now; `overlap`: collected at the next step), published every `publish_interval` rounds."""
        out: dict[str, float] = {}
        last = self.global_steps >= self.total_training_steps
        if self.global_steps % self.speco.train_interval == 0:
            if ray.get(self._speco_drafter.next_round_steps.remote()) > 0:
                self._speco_round_ref = self._speco_drafter.train_round.remote()
                self._speco_round_started = time.perf_counter()
                if self.speco.schedule == "serial" or last:
                    out.update(self._speco_finish_round())
            elif "empty" not in self._speco_warned:
                self._speco_warned.add("empty")
                print("verl_speco: no rows captured since the previous drafter round; skipping this round")
        return out

    def _speco_read_counters(self) -> SpecCounters | None:
        """The rollout servers' cumulative spec-decode counters, summed over replicas (None: no replicas)."""
        manager = getattr(self, "checkpoint_manager", None)
        replicas = list(getattr(manager, "replicas", []) or [])
        if not replicas:
            return None
        now = SpecCounters()
        for counters in _gather_counters(replicas):
            now = now + counters
        return now

    def _speco_acceptance(self) -> dict[str, float]:
        """This step's acceptance from the rollout servers' own spec-decode counters (the difference
        of the cumulative counters since the previous step, summed over replicas; validation excluded)."""
        now = self._speco_read_counters()
        if now is None:
            return {}
        previous, self._speco_counters = self._speco_counters, now
        return _acceptance_metrics(now - previous, "drafter/accept")

    def _validate(self) -> dict[str, float]:
        """verl's validation (the held-out `data.val_files`, `rollout.val_kwargs`: greedy by default),
        plus the draft's acceptance on it from the servers' counters (`drafter/heldout/*`): the draft
        and policy of the step that just ended (validation runs after its weight sync)."""
        before = self._speco_read_counters() if self.speco_online else None
        out = dict(super()._validate())  # type: ignore[misc]
        after = self._speco_read_counters() if before is not None else None
        if before is not None and after is not None:
            self._speco_counters = self._speco_counters + (after - before)  # not counted as rollout
            out.update(_acceptance_metrics(after - before, "drafter/heldout"))
            held = self._speco_loaded.get(id(getattr(self, "checkpoint_manager", None)), -1)
            out["drafter/heldout/served_version"] = float(held)  # the version the servers loaded last
            if self._speco_baseline is not None:
                out.update(self._speco_validate_baseline(out.get("drafter/heldout/mean_acceptance_length")))
        return out

    def _speco_validate_baseline(self, served_length: float | None) -> dict[str, float]:
        """verl's validation once more with the initial draft serving on the same policy
        (`speco_apply_baseline`; its own validation metrics are dropped), then the held draft back
        (`speco_restore_draft`): `drafter/heldout_baseline/*` and `drafter/heldout/gain`."""
        assert self._speco_baseline is not None
        replicas = list(getattr(getattr(self, "checkpoint_manager", None), "replicas", []) or [])
        path, version = self._speco_baseline
        status, reasons = load_outcome(_call_replicas(replicas, "speco_apply_baseline", (path, version)))
        try:
            if status != "loaded":
                logger.warning("drafter heldout_baseline: the initial draft was not served (%s): %s", status,
                               "; ".join(reasons))
                return {"drafter/heldout_baseline/refused": 1.0}
            before = self._speco_read_counters()
            super()._validate()  # type: ignore[misc]
            after = self._speco_read_counters()
        finally:
            _call_replicas(replicas, "speco_restore_draft")
        if before is None or after is None:
            return {}
        self._speco_counters = self._speco_counters + (after - before)  # not counted as rollout
        out = _acceptance_metrics(after - before, "drafter/heldout_baseline")
        base = out.get("drafter/heldout_baseline/mean_acceptance_length")
        if served_length is not None and base:
            out["drafter/heldout/gain"] = float(served_length) / float(base)
        return out

    def _speco_finish_round(self) -> dict[str, float]:
        waited = time.perf_counter()
        result = ray.get(self._speco_round_ref)
        self._speco_round_ref = None
        now = time.perf_counter()
        out = {f"drafter/{k}": float(v) for k, v in result.items()}
        out["drafter/train_wait_seconds"] = now - waited
        out["drafter/train_wall_seconds"] = now - self._speco_round_started
        self._speco_rounds += 1
        if self._speco_rounds % self.speco.publish_interval == 0:
            out.update(self._speco_publish_now())
        return out

    def _speco_publish_now(self) -> dict[str, float]:
        pub = ray.get(self._speco_drafter.publish.remote())
        self._speco_latest = pub  # the servers sleep now; loaded after the next weight sync
        return {"drafter/version": float(pub["version"]), "drafter/publish_seconds": float(pub["seconds"]),
                "drafter/publish_bytes": float(pub["bytes"])}


def _acceptance_metrics(delta: SpecCounters, prefix: str) -> dict[str, float]:
    summary = acceptance_summary(delta)
    if not summary["num_drafts"]:  # no draft in this window, or a server without counters (SGLang)
        return {f"{prefix}/num_drafts": 0.0}
    out = {f"{prefix}/num_drafts": float(summary["num_drafts"]),
           f"{prefix}/mean_acceptance_length": float(summary["mean_acceptance_length"]),
           f"{prefix}/draft_acceptance_rate": float(summary["draft_acceptance_rate"])}
    for i, rate in enumerate(summary["per_position_acceptance_rate"]):
        out[f"{prefix}/pos{i + 1}"] = float(rate)
    return out


@auto_await
async def _call_replicas(replicas: list[Any], method: str, args: tuple = ()) -> list[Any]:
    return await SpecoTrainerMixin._speco_replica_call(replicas, method, args)


@auto_await
async def _gather_counters(replicas: list[Any]) -> list[SpecCounters]:
    return list(await asyncio.gather(*[r.speco_spec_counters() for r in replicas]))


_CLASSES: dict[type, type] = {}


def speco_trainer_cls(base: type) -> type:
    """`Speco<Base>`: the mixin in front of verl trainer class `base` (one class per base)."""
    if base not in _CLASSES:
        _CLASSES[base] = type(f"Speco{base.__name__}", (SpecoTrainerMixin, base), {"__module__": __name__})
    return _CLASSES[base]
