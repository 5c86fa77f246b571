"""The online data path end to end, in one process with a local Ray: capture in the worker's
old-logprob pass -> `speco_end_step` (rows and head put in Ray's object store) -> the trainer's
step boundary (`trainer_step.after_step`, the `OnlineController` behind it) -> `DrafterWorker` (a real
`DrafterSession` on the tiny target) -> training round (serial / overlap) -> versioned publish."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from speco_verl_helpers import tiny_qwen3
from test_speco_capture import LAYER_IDS, LENGTHS, RESPONSES, make_batch, make_worker
from verl.utils import tensordict_utils as tu

from verl_speco.online.config import CaptureCaps, DrafterRunConfig
from verl_speco.verl_integration.worker import POLICY_VERSION_KEY

ray = pytest.importorskip("ray")


@pytest.fixture(scope="module")
def local_ray() -> Any:
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


class LocalHandle:
    """`handle.method.remote(...)` runs in this process and returns an object ref (no actor)."""

    def __init__(self, obj: Any):
        self._obj = obj

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._obj, name)

        class _Remote:
            @staticmethod
            def remote(*args: Any) -> Any:
                return ray.put(method(*args))

        return _Remote


class WorkerGroup:
    """verl's worker group as the trainer calls it: ONE_TO_ALL methods return one answer per rank."""

    def __init__(self, workers: list[Any]):
        self.workers = workers

    def speco_end_step(self, step: int) -> list[dict]:
        return [w.speco_end_step(step) for w in self.workers]


@pytest.mark.parametrize(("schedule", "drafters"), [("serial", "in_process"), ("overlap", "in_process"),
                                                    ("overlap", "ray_group_of_2")])
def test_rows_train_and_publish_through_the_trainer(local_ray: Any, tmp_path: Path, schedule: str,
                                                    drafters: str) -> None:
    """`in_process`: the drafter worker called in this process; `ray_group_of_2`: the real drafter worker
    group (2 Ray actors, gloo, FSDP2) behind the handle the trainer uses in a run."""
    from verl.trainer.ppo.v1 import get_trainer_cls

    from verl_speco.online.controller import OnlineController
    from verl_speco.verl_integration import trainer_step
    from verl_speco.verl_integration.drafter_actor import DrafterWorker, RayDrafterLink, start_drafter_group
    from verl_speco.verl_integration.trainer import speco_trainer_cls

    model = tiny_qwen3()
    target = tmp_path / "target"
    model.save_pretrained(target)
    cfg = DrafterRunConfig(enable=True, mode="online", schedule=schedule, train_steps_per_round=2,
                           micro_batch_size=2, publish_interval=1, publish_dir=str(tmp_path / "publish"),
                           caps=CaptureCaps(max_rows=4), settings={"aux_layer_ids": list(LAYER_IDS)},
                           num_workers=2 if drafters == "ray_group_of_2" else 1)
    drafter: Any = None
    if drafters == "in_process":
        drafter = DrafterWorker(dataclasses.asdict(cfg), str(target), "t")
        handle: Any = LocalHandle(drafter)
    else:
        handle = start_drafter_group(cfg, str(target), f"t-{schedule}")
    layer_ids = ray.get(handle.layer_ids.remote())
    assert layer_ids == list(LAYER_IDS)
    ranks = [make_worker(model, cfg, use_remove_padding=True) for _ in range(2)]
    ranks[1]._rank = 1
    for w in ranks:
        assert w.speco_init(layer_ids, 64, 96, "tiny")["armed"]

    trainer: Any = object.__new__(speco_trainer_cls(get_trainer_cls("sync")))
    trainer.speco, trainer.speco_ctl = cfg, OnlineController(cfg, RayDrafterLink(handle))
    trainer.actor_rollout_wg = WorkerGroup(ranks)
    trainer.total_training_steps = 3
    logged = []
    for step in (1, 2, 3):
        trainer.global_steps = step
        for w in ranks:  # each rank's shard of the batch, through its old-logprob pass
            data = make_batch(LENGTHS, RESPONSES, vocab=96, seed=10 * step + w.rank)
            tu.assign_non_tensor(data, **{POLICY_VERSION_KEY: step - 1})
            w.compute_log_prob(data)
        logged.append(trainer_step.after_step(trainer))
    first, _, last = logged
    assert first["drafter/capture/kept"] == 8 and first["drafter/rows_added"] == 8
    assert all(k.startswith("drafter/") for m in logged for k in m)
    if schedule == "serial":  # trained and published at every step boundary
        assert [m["drafter/version"] for m in logged] == [1.0, 2.0, 3.0]
        assert first["drafter/steps"] == 2.0 and torch.isfinite(torch.tensor(first["drafter/loss"]))
    else:  # started at step s, collected at s + 1 (the last step finishes its own round)
        assert "drafter/version" not in first and logged[1]["drafter/version"] == 1.0
        assert last["drafter/version"] == 3.0 and not trainer.speco_ctl.in_flight
    assert trainer.speco_ctl.latest["version"] == 3
    assert (Path(trainer.speco_ctl.latest["path"]) / "manifest.json").is_file()
    if drafter is not None:
        assert drafter.session.buffer.latest_version == 2  # rows keep the policy version they came from
    else:
        for actor in handle.actors:
            ray.kill(actor)


class CountingReplica:
    """A rollout replica's `speco_spec_counters` as the servers report it: cumulative counters."""

    def __init__(self, snapshots: list[Any]):
        self.snapshots = iter(snapshots)

    async def speco_spec_counters(self) -> Any:
        return next(self.snapshots)


def test_step_acceptance_is_the_delta_of_the_servers_counters_summed_over_replicas() -> None:
    from verl.trainer.ppo.v1 import get_trainer_cls

    from verl_speco.engines.spec_metrics import SpecCounters
    from verl_speco.online.controller import OnlineController
    from verl_speco.verl_integration.trainer import speco_trainer_cls
    from verl_speco.verl_integration.weight_sync import read_counters

    trainer: Any = object.__new__(speco_trainer_cls(get_trainer_cls("sync")))
    no_drafter: Any = None  # acceptance never reaches the drafter
    ctl = OnlineController(DrafterRunConfig(enable=True, mode="online"), no_drafter)
    a = CountingReplica([SpecCounters(10, 30, 15, (8, 5, 2)), SpecCounters(14, 42, 24, (12, 8, 4))])
    b = CountingReplica([SpecCounters(6, 18, 3, (3, 0, 0)), SpecCounters(6, 18, 3, (3, 0, 0))])
    trainer.checkpoint_manager = type("Manager", (), {"replicas": [a, b]})()
    step1 = ctl.acceptance(read_counters(trainer))
    # step 1: 16 drafts, 18 accepted -> 1 + 18/16; position 1: (8 + 3) / 16
    assert step1["drafter/accept/num_drafts"] == 16.0
    assert step1["drafter/accept/mean_acceptance_length"] == 1 + 18 / 16
    assert step1["drafter/accept/pos1"] == 11 / 16 and step1["drafter/accept/pos3"] == 2 / 16
    step2 = ctl.acceptance(read_counters(trainer))
    # step 2 only: replica a drafted 4 more (9 accepted: 4, 3, 2 by position), replica b nothing
    assert step2["drafter/accept/num_drafts"] == 4.0
    assert step2["drafter/accept/mean_acceptance_length"] == 1 + 9 / 4
    assert [step2[f"drafter/accept/pos{i}"] for i in (1, 2, 3)] == [4 / 4, 3 / 4, 2 / 4]


@pytest.mark.parametrize("capture_pass", ["old_logprob", "post_update"])
def test_trainer_tags_the_pass_the_capture_rides_on(capture_pass: str) -> None:
    """old_logprob tags verl's old-logprob call with `global_steps - 1`; post_update tags the update
    with `global_steps` (the version after it); the tags never outlive the call."""
    from verl.trainer.ppo.v1 import get_trainer_cls

    from verl_speco.verl_integration.trainer import speco_trainer_cls
    from verl_speco.verl_integration.worker import POST_UPDATE_VERSION_KEY

    seen: list[tuple[str, dict]] = []

    class Base:
        def _compute_old_log_prob(self, batch: Any, metrics: dict) -> Any:
            seen.append(("old_log_prob", dict(batch.extra_info)))
            return batch

        def _update_actor(self, batch: Any, metrics: dict) -> Any:
            seen.append(("update", dict(batch.extra_info)))
            return batch

    assert get_trainer_cls("sync")  # the mixin goes in front of verl's trainers (test_contract); here of Base
    trainer: Any = object.__new__(speco_trainer_cls(Base))  # type: ignore[arg-type]
    trainer.speco = DrafterRunConfig(enable=True, capture_pass=capture_pass, collect_interval=2)
    batch = type("Batch", (), {"extra_info": {}})()
    for step in (1, 2, 3):
        trainer.global_steps = step
        trainer._compute_old_log_prob(batch, {})
        trainer._update_actor(batch, {})
    assert batch.extra_info == {}
    tags = [(name, info.get(POLICY_VERSION_KEY), info.get(POST_UPDATE_VERSION_KEY)) for name, info in seen]
    if capture_pass == "old_logprob":  # steps 1 and 3 capture (collect_interval=2)
        assert tags == [("old_log_prob", 0, None), ("update", None, None), ("old_log_prob", None, None),
                        ("update", None, None), ("old_log_prob", 2, None), ("update", None, None)]
    else:
        assert tags == [("old_log_prob", None, None), ("update", None, 1), ("old_log_prob", None, None),
                        ("update", None, None), ("old_log_prob", None, None), ("update", None, 3)]
