"""What `SpecoTrainerMixin`'s hooks do inside a verl step (`t` is the trainer): fetch the step's rows, store
them (collect_only) or hand them to the `OnlineController` (online), the fresh samples' round, and the
held-out acceptance of verl's validation."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

import ray

from verl_speco.online.publish import load_outcome
from verl_speco.verl_integration.weight_sync import call_replicas, read_counters, replicas_of
from verl_speco.verl_integration.worker import COUNT_KEYS, POLICY_VERSION_KEY

logger = logging.getLogger(__name__)


def sum_counts(results: list[dict[str, Any]]) -> dict[str, int]:
    total = dict.fromkeys(COUNT_KEYS, 0)
    for r in results:
        for k in COUNT_KEYS:
            total[k] += int(r.get("counts", {}).get(k, 0))
    return total


def rows_and_head(results: list[dict[str, Any]]) -> tuple[list[Any], Any]:
    """The workers' `speco_end_step` results -> (every rank's row refs, the first target-head snapshot or None)."""
    heads = [r["head"] for r in results if r.get("head") is not None]
    return [ref for r in results for ref in r.get("rows", [])], heads[0] if heads else None


def after_step(t: Any) -> dict[str, float]:
    """After verl's step: the workers' rows (or the rollout's) to the store or the controller."""
    if t._speco_rollout is not None:
        return after_rollout_step(t)
    results = t.actor_rollout_wg.speco_end_step(t.global_steps)
    out = {f"drafter/capture/{k}": float(v) for k, v in sum_counts(results).items()}
    out["drafter/capture/seconds_max"] = max((float(r.get("capture_seconds", 0.0)) for r in results), default=0.0)
    if not t.speco_online:
        out["drafter/store/seconds_max"] = max((float(r.get("store_seconds", 0.0)) for r in results), default=0.0)
        out["drafter/store/samples"] = float(sum(int(r.get("store_samples", 0)) for r in results))
        return out
    return {**out, **online_step(t, *rows_and_head(results))}


def online_step(t: Any, rows: list[Any], head: Any) -> dict[str, float]:
    return t.speco_ctl.end_step(t.global_steps, t.global_steps >= t.total_training_steps, rows, head,
                                read_counters(t))


def take_rollout_rows(t: Any, batch: Any) -> None:
    """This step's rows from the rollout's returned hidden states (before the update: the rows and the
    head snapshot are of the policy that generated them)."""
    import transfer_queue as tq

    from verl_speco.verl_integration.rollout_rows import read_rollout_entries

    version = t.global_steps - 1
    rows = t._speco_rollout.rows_from_encoded(read_rollout_entries(batch, tq.kv_batch_get), version)
    head = None
    if t.speco_online:
        heads = [h for h in t.actor_rollout_wg.speco_snapshot_head(version) if h is not None]
        head = heads[0] if heads else None
    t._speco_pending = (rows, head)


def after_rollout_step(t: Any) -> dict[str, float]:
    """`after_step` when the rows came from the rollout (`take_rollout_rows`)."""
    from verl_speco.online.rollout_capture import capture_metrics

    pending, t._speco_pending = t._speco_pending, None
    out: dict[str, float] = {}
    refs: list[Any] = []
    head = None
    if pending is not None:
        rows, head = pending
        out.update(capture_metrics(rows))
        if t._speco_sink is not None:
            started = time.perf_counter()
            t._speco_sink.write(rows, t.global_steps)
            t._speco_sink.end_step(t.global_steps)
            out["drafter/store/seconds_max"] = time.perf_counter() - started
            out["drafter/store/samples"] = float(t._speco_sink.samples)
            if t.global_steps >= t.total_training_steps:
                t._speco_sink.close()
                t._speco_sink = None
        elif rows.records:
            refs = [ray.put(rows.to_bytes())]
    if not t.speco_online:
        return out
    return {**out, **online_step(t, refs, head)}


def fresh_round(t: Any) -> dict[str, float]:
    """`drafter.fresh_samples` (`fresh_samples.py`): the fresh rows added to the step's, then the round, the
    publish, and a weight sync that hands the servers the new draft."""
    import transfer_queue as tq

    ctl = t.speco_ctl
    started = time.perf_counter()
    count, steps = t.speco.fresh_samples, t.global_steps
    prompts = t._speco_fresh.next_batch(steps)
    tags = [{"is_prompt": True, "status": "pending", "global_steps": steps} for _ in range(count)]
    before = read_counters(t)
    tq.kv_batch_put(keys=list(prompts["uid"]), partition_id="train", tags=tags)
    t.agent_loop_manager.generate_sequences(prompts)
    batch, _ = t.replay_buffer.sample(global_steps=steps, partition_id="train", batch_size=count)
    after = read_counters(t)
    out: dict[str, float] = {"drafter/fresh/generate_seconds": time.perf_counter() - started}
    out.update(ctl.count_aside(before, after, "drafter/fresh"))  # not counted as rollout
    t.checkpoint_manager.sleep_replicas()  # as before verl's own actor passes
    try:
        batch = t._balance_batch(batch, metrics={})
        batch.extra_info.update({"calculate_entropy": True, "compute_loss": False,
                                 "temperature": t.config.actor_rollout_ref.rollout.temperature,
                                 POLICY_VERSION_KEY: steps})  # rows of the updated policy, version `steps`
        t.actor_rollout_wg.compute_log_prob(batch)
    finally:
        tq.kv_clear(keys=batch.keys, partition_id=batch.partition_id)
    results = t.actor_rollout_wg.speco_end_step(steps)
    out.update({f"drafter/fresh/capture/{k}": float(v) for k, v in sum_counts(results).items()})
    out.update(ctl.add(*rows_and_head(results), "drafter/fresh"))
    out.update(ctl.maybe_train(steps, steps >= t.total_training_steps))
    t.checkpoint_manager.update_weights(steps)  # wakes the servers; `after_weights` loads the draft
    out["drafter/fresh/seconds"] = time.perf_counter() - started
    return out


def validate(t: Any, verl_validate: Callable[[], dict]) -> dict[str, float]:
    """verl's validation plus the draft's held-out acceptance from the servers' counters (`drafter/heldout/*`),
    for the draft and policy of the step that just ended."""
    ctl = t.speco_ctl if t.speco_online else None
    before = read_counters(t) if ctl is not None else None
    out = dict(verl_validate())
    if ctl is None or before is None:
        return out
    after = read_counters(t)
    if after is None:
        return out
    out.update(ctl.count_aside(before, after, "drafter/heldout"))  # not counted as rollout
    out["drafter/heldout/served_version"] = float(ctl.held(id(getattr(t, "checkpoint_manager", None))))
    if t._speco_baseline is not None:
        out.update(validate_baseline(t, verl_validate, out.get("drafter/heldout/mean_acceptance_length")))
    return out


def validate_baseline(t: Any, verl_validate: Callable[[], dict], served_length: float | None) -> dict[str, float]:
    """verl's validation again with the initial draft serving (`speco_apply_baseline`), then the held draft
    back: `drafter/heldout_baseline/*` and `drafter/heldout/gain`."""
    replicas = replicas_of(t)
    path, version = t._speco_baseline
    status, reasons = load_outcome(call_replicas(replicas, "speco_apply_baseline", (path, version)))
    try:
        if status != "loaded":
            logger.warning("drafter heldout_baseline: the initial draft was not served (%s): %s", status,
                           "; ".join(reasons))
            return {"drafter/heldout_baseline/refused": 1.0}
        before = read_counters(t)
        verl_validate()
        after = read_counters(t)
    finally:
        call_replicas(replicas, "speco_restore_draft")
    out = t.speco_ctl.count_aside(before, after, "drafter/heldout_baseline")
    base = out.get("drafter/heldout_baseline/mean_acceptance_length")
    if served_length is not None and base:
        out["drafter/heldout/gain"] = float(served_length) / float(base)
    return out
