"""`SpecoActorRolloutRefWorker`: verl's hybrid actor/rollout/ref worker with drafter capture in the
old-logprob pass (or, with `capture_pass=post_update`, one extra forward of the updated actor): rows
planned from the masks, hooks keeping only the planned rows per micro-batch, the head snapshotted, and
`speco_end_step` handing the rows to the drafter group (online) or the Feature Store (collect_only)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from verl.single_controller.base.decorator import Dispatch, make_nd_compute_dataproto_dispatch_fn, register
from verl.utils import tensordict_utils as tu
from verl.workers.engine_workers import ActorRolloutRefWorker

from verl_speco.online.capture import CapturedRows, OnlineCapture, plan_rows
from verl_speco.online.config import DrafterConfigError, DrafterRunConfig
from verl_speco.verl_integration.batch_rows import (
    ROW_ID_KEY,
    MicroBatchSelection,
    assemble,
    full_sequence_masks,
)
from verl_speco.verl_integration.config_bridge import drafter_from_actor_rollout_ref

_Dispatch: Any = Dispatch  # verl's DynamicEnum: members are created at run time
ONE_TO_ALL = _Dispatch.ONE_TO_ALL
POLICY_VERSION_KEY = "speco_policy_version"  # set by the trainer on steps that capture (old_logprob)
POST_UPDATE_VERSION_KEY = "speco_post_update_version"  # the same, for capture_pass=post_update
COUNT_KEYS = ("seen", "kept", "truncated", "dropped_short", "dropped_rows_cap", "dropped_tokens_cap", "tokens")


def _row_lengths(micro_batch: Any) -> torch.Tensor:
    ids = micro_batch["input_ids"]
    if ids.is_nested:
        return ids.offsets().diff().cpu()
    return micro_batch["attention_mask"].sum(-1).cpu()


def capture_seed(seed: int, rank: int) -> int:
    return int(seed) + 7919 * int(rank)


class SpecoActorRolloutRefWorker(ActorRolloutRefWorker):
    """verl's `ActorRolloutRefWorker` plus drafter capture (see the module docstring)."""

    def __init__(self, config: Any, role: str, distillation_config: Any = None, **kwargs: Any):
        super().__init__(config, role, distillation_config=distillation_config, **kwargs)
        self._speco_reset(drafter_from_actor_rollout_ref(config))

    def _speco_reset(self, cfg: DrafterRunConfig) -> None:
        self.speco_cfg = cfg
        self._speco_capture: OnlineCapture | None = None
        self._speco_sink: Any = None
        self._speco_rows: list[CapturedRows] = []
        self._speco_head: Any = None
        self._speco_counts: dict[str, int] = dict.fromkeys(COUNT_KEYS, 0)
        self._speco_seconds = 0.0

    @register(dispatch_mode=ONE_TO_ALL)
    def speco_init(self, layer_ids: list[int], hidden_size: int, vocab_size: int, target_model_id: str) -> dict:
        """Arm the capture (and, in collect_only mode, open this rank's Feature Store writer)."""
        cfg = self.speco_cfg
        if not cfg.enable or cfg.mode == "offline":
            return {"rank": self.rank, "armed": False}
        if self.actor is None:
            raise DrafterConfigError(f"drafter capture needs the actor role; this worker has role {self.role!r}")
        sp = int(getattr(self.actor.engine, "ulysses_sequence_parallel_size", 1) or 1)
        if sp > 1:
            raise DrafterConfigError(
                f"actor_rollout_ref.actor.ulysses_sequence_parallel_size: got {sp}, expected 1 with "
                "actor_rollout_ref.rollout.drafter.enable=true (each rank would see a slice of every sequence)")
        self._speco_capture = OnlineCapture(tuple(int(i) for i in layer_ids), cfg.caps,
                                            seed=capture_seed(cfg.seed, self.rank))
        if cfg.mode == "collect_only":
            from verl_speco.online.sink import StoreSink

            self._speco_sink = StoreSink(cfg.feature_store, tuple(int(i) for i in layer_ids), int(hidden_size),
                                         int(vocab_size), target_model_id, rank=self.rank,
                                         producer={"family": cfg.family})
        return {"rank": self.rank, "armed": True}

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="actor"))
    def compute_log_prob(self, data: Any) -> Any:
        version = tu.get(data, POLICY_VERSION_KEY, default=None)
        if self._speco_capture is None or version is None:
            return super().compute_log_prob(data)
        with self._speco_capture_pass(data, int(version)):
            return super().compute_log_prob(data)

    @register(dispatch_mode=make_nd_compute_dataproto_dispatch_fn(mesh_name="actor"))
    def update_actor(self, data: Any) -> Any:
        """verl's update; with `capture_pass=post_update` then one forward of the updated actor over the
        same batch under the capture (its output is discarded): rows of the policy the next rollout runs."""
        output = super().update_actor(data)
        version = tu.get(data, POST_UPDATE_VERSION_KEY, default=None)
        if self._speco_capture is not None and version is not None:
            assert self.actor is not None  # speco_init refused a worker without the actor role
            tu.assign_non_tensor(data, compute_loss=False)  # forward only: no loss, no metrics of it
            with self._speco_capture_pass(data, int(version)):
                self.actor.infer_batch(data)
        return output

    @contextmanager
    def _speco_capture_pass(self, data: Any, version: int) -> Iterator[None]:
        capture = self._speco_capture
        assert capture is not None and self.actor is not None
        started = time.perf_counter()
        loss_mask = data["loss_mask"] if "loss_mask" in data.keys() else data["response_mask"]
        attention = data["attention_mask"] if "attention_mask" in data.keys() else None
        ids, am, lm = full_sequence_masks(data["input_ids"], loss_mask, attention)
        plan = plan_rows(am, lm, capture.caps, capture.seed + 1_000_003 * version)
        keep = set(plan.rows)
        data[ROW_ID_KEY] = torch.arange(ids.shape[0])
        engine: Any = self.actor.engine
        module = engine.module
        original = engine.forward_step
        parts: list[tuple[MicroBatchSelection, Any]] = []
        want_head = self.speco_cfg.mode == "online"
        heads: list[Any] = []

        with capture.hooks(module) as hooked:
            def forward_step(micro_batch: Any, loss_function: Any, forward_only: Any) -> Any:
                if want_head and not heads:
                    from verl_speco.online.session import TargetHeadSnapshot

                    heads.append(TargetHeadSnapshot.from_model(module, version, dtype=torch.bfloat16))
                packed = bool(tu.get(micro_batch, "use_remove_padding", default=True))
                sel = MicroBatchSelection.build(micro_batch[ROW_ID_KEY], _row_lengths(micro_batch), keep, packed)
                hooked.select = sel
                out = original(micro_batch, loss_function=loss_function, forward_only=forward_only)
                passes = hooked.pop_all()
                if len(passes) != 1:
                    raise RuntimeError(f"drafter capture: expected 1 hooked forward per micro-batch, got "
                                       f"{len(passes)} (is the actor module an HF decoder?)")
                if sel.row_ids:
                    parts.append((sel, passes[0]))
                return out

            engine.forward_step = forward_step
            try:
                yield
            finally:
                del engine.forward_step  # the class method again
                if ROW_ID_KEY in data.keys():
                    del data[ROW_ID_KEY]
        for key in COUNT_KEYS:
            self._speco_counts[key] += int(plan.counts.get(key, 0))
        if parts:
            rows_order, feats = assemble(parts)
            if rows_order != plan.rows:
                raise RuntimeError(f"drafter capture: captured rows {rows_order[:8]}... differ from the planned "
                                   f"{plan.rows[:8]}... (a micro-batch was not run through the hooked forward)")
            kept = torch.tensor(plan.rows, dtype=torch.long)
            self._speco_rows.append(capture.collect([feats], ids[kept], am[kept], lm[kept], version))
        if heads and self.rank == 0:
            self._speco_head = heads[0]
        self._speco_seconds += time.perf_counter() - started

    @register(dispatch_mode=ONE_TO_ALL)
    def speco_end_step(self, global_step: int) -> dict:
        """Hand this step's rows on (see the module docstring); returns this rank's counters."""
        import ray

        rows, self._speco_rows = self._speco_rows, []
        head, self._speco_head = self._speco_head, None
        counts, self._speco_counts = self._speco_counts, dict.fromkeys(COUNT_KEYS, 0)
        seconds, self._speco_seconds = self._speco_seconds, 0.0
        out: dict[str, Any] = {"rank": self.rank, "counts": counts, "capture_seconds": seconds,
                               "rows": [], "head": None}
        if self._speco_sink is not None:
            started = time.perf_counter()
            for r in rows:
                self._speco_sink.write(r, global_step)
            self._speco_sink.end_step(global_step)
            out["store_seconds"] = time.perf_counter() - started
            out["store_samples"] = self._speco_sink.samples
            return out
        # safetensors bytes (CapturedRows/TargetHeadSnapshot.to_bytes): our objects never travel pickled
        out["rows"] = [ray.put(r.to_bytes()) for r in rows if r.records]
        out["head"] = ray.put(head.to_bytes()) if head is not None else None
        return out

    @register(dispatch_mode=ONE_TO_ALL)
    def speco_snapshot_head(self, version: int) -> Any:
        """The actor's target head now (for rollout-captured rows); a collective under FSDP2. Rank 0 returns
        an object reference to its safetensors bytes, the others None."""
        import ray

        from verl_speco.online.session import TargetHeadSnapshot

        if self.actor is None:
            raise DrafterConfigError(f"drafter head snapshot needs the actor role; this worker has role {self.role!r}")
        engine: Any = self.actor.engine
        head = TargetHeadSnapshot.from_model(engine.module, int(version), dtype=torch.bfloat16)
        return ray.put(head.to_bytes()) if self.rank == 0 else None

    @register(dispatch_mode=ONE_TO_ALL)
    def speco_close(self) -> bool:
        if self._speco_sink is not None:
            self._speco_sink.close()
            self._speco_sink = None
        return True
