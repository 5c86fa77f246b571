"""Contract with the installed verl: every class, method and signature verl_speco relies on.

If verl changes one of these, this file fails first and names it (verl_speco/verl_integration is
written against verl 0.9.1). Also checks that our subclasses install on verl's real classes.
"""

from __future__ import annotations

import asyncio
import inspect
from pathlib import Path
from typing import Any

import pytest
from speco_verl_helpers import compose

PARAMS: list[tuple[str, str, list[str]]] = [
    # (module, qualname, leading parameter names)
    ("verl.trainer.main_ppo", "run_ppo", ["config", "task_runner_class"]),
    ("verl.trainer.ppo.v1", "get_trainer_cls", ["name"]),
    ("verl.trainer.ppo.v1.trainer_base", "PPOTrainer.__init__", ["self", "config"]),
    ("verl.trainer.ppo.v1.trainer_base", "PPOTrainer._setup", ["self"]),
    ("verl.trainer.ppo.v1.trainer_base", "PPOTrainer._init_resource_pool_mgr", ["self"]),
    ("verl.trainer.ppo.v1.trainer_base", "PPOTrainer._compute_old_log_prob", ["self", "batch", "metrics"]),
    ("verl.trainer.ppo.v1.trainer_base", "PPOTrainer._update_actor", ["self", "batch", "metrics"]),
    ("verl.trainer.ppo.v1.trainer_base", "PPOTrainer.step", ["self", "metrics", "timing_raw"]),
    ("verl.trainer.ppo.v1.trainer_base", "PPOTrainer._consume_sync_metrics", ["self"]),
    ("verl.trainer.ppo.v1.trainer_base", "PPOTrainer.fit", ["self", "agent_loop_manager"]),
    ("verl.workers.engine_workers", "ActorRolloutRefWorker.__init__", ["self", "config", "role", "distillation_config"]),
    ("verl.workers.engine_workers", "ActorRolloutRefWorker.compute_log_prob", ["self", "data"]),
    ("verl.workers.engine_workers", "ActorRolloutRefWorker.update_actor", ["self", "data"]),
    ("verl.workers.engine_workers", "TrainingWorker.infer_batch", ["self", "data"]),
    ("verl.workers.engine.fsdp.transformer_impl", "FSDPEngine.forward_step",
     ["self", "micro_batch", "loss_function", "forward_only"]),
    ("verl.workers.engine.fsdp.transformer_impl", "FSDPEngineWithLMHead.prepare_model_inputs", ["self", "micro_batch"]),
    ("verl.workers.engine.utils", "prepare_micro_batches", ["data", "dp_group"]),
    ("verl.utils.tensordict_utils", "get", ["tensordict", "key", "default"]),
    ("verl.single_controller.base.decorator", "register", ["dispatch_mode", "execute_mode", "blocking"]),
    ("verl.single_controller.base.decorator", "make_nd_compute_dataproto_dispatch_fn", ["mesh_name"]),
    ("verl.checkpoint_engine.base", "CheckpointEngineManager.__init__", ["self", "config", "actor_wg", "replicas"]),
    ("verl.workers.rollout.replica", "RolloutReplicaRegistry.register", ["name", "loader"]),
    ("verl.workers.rollout.replica", "get_rollout_replica_class", ["rollout"]),
    ("verl.utils.fs", "copy_to_local", ["src", "cache_dir", "filelock", "verbose", "always_recopy", "use_shm"]),
    ("verl.utils.config", "omega_conf_to_dataclass", ["config", "dataclass_type"]),
    ("verl.utils.config", "validate_config", ["config", "use_reference_policy", "use_critic"]),
]

SOURCE_PINS: list[tuple[str, str, list[str]]] = [
    # what our overrides mirror or depend on, as it appears in verl's source
    ("verl.trainer.main_ppo", "TaskRunnerV1", [
        "get_trainer_cls(config.trainer.v1.trainer_mode)", "tq.init(config.transfer_queue)",
        "self.trainer.init()", "self.init_agent_loop_manager()", "self.trainer.fit(self.agent_loop_manager)"]),
    ("verl.trainer.ppo.v1.trainer_base", "PPOTrainer._compute_old_log_prob", [
        "self.actor_rollout_wg.compute_log_prob(batch)", "batch.extra_info.update("]),
    ("verl.trainer.ppo.v1.trainer_base", "PPOTrainer._step_once", [
        "self._compute_old_log_prob(batch", "self._update_actor(batch"]),
    ("verl.trainer.ppo.v1.trainer_base", "PPOTrainer.fit", [
        "self.step(metrics, self.timing_raw)", "self.on_step_end()", "metrics.update(self._consume_sync_metrics())",
        "self.logger.log(data=metrics"]),
    ("verl.trainer.ppo.v1.trainer_base", "PPOTrainer._init_resource_pool_mgr", [
        "self.role_worker_mapping[role] = ray.remote(ActorRolloutRefWorker)"]),
    ("verl.trainer.ppo.v1.trainer_base", "PPOTrainer._setup", [
        "self.checkpoint_manager: CheckpointEngineManager = CheckpointEngineManager(", "LLMServerManager.create("]),
    ("verl.workers.engine_workers", "ActorRolloutRefWorker.compute_log_prob", ["self.actor.infer_batch(data)"]),
    ("verl.workers.engine_workers", "ActorRolloutRefWorker.update_actor", ["self.actor.train_mini_batch(data=data)"]),
    ("verl.trainer.ppo.v1.trainer_base", "PPOTrainer._update_actor", [
        "batch.extra_info.update(extra_info)", "self.actor_rollout_wg.update_actor(batch)"]),
    ("verl.workers.engine.fsdp.transformer_impl", "FSDPEngine.forward_backward_batch", [
        "prepare_micro_batches(", "self.forward_step(micro_batch, loss_function=loss_function, forward_only=forward_only)"]),
    ("verl.workers.engine.fsdp.transformer_impl", "FSDPEngineWithLMHead.prepare_model_inputs", [
        "input_ids.values().unsqueeze(0)", "torch.nested.to_padded_tensor("]),
    ("verl.trainer.ppo.v1.agent_loop_tq", "AgentLoopWorkerTQ._agent_loop_postprocess", [
        'field["loss_mask"] = field["response_mask"]', "input_ids = torch.cat([prompts, responses], dim=0)"]),
    ("verl.checkpoint_engine.base", "CheckpointEngineManager.update_weights", ["self.actor_wg.update_weights("]),
    ("verl.workers.rollout.replica", "RolloutReplicaRegistry", ["cls._registry[name] = loader"]),
]


def _resolve(module: str, qualname: str) -> Any:
    obj: Any = __import__(module, fromlist=["_"])
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


@pytest.mark.parametrize(("module", "qualname", "names"), PARAMS, ids=[f"{m}:{q}" for m, q, _ in PARAMS])
def test_signatures(module: str, qualname: str, names: list[str]) -> None:
    obj = _resolve(module, qualname)
    obj = inspect.unwrap(obj)
    params = list(inspect.signature(obj).parameters)
    assert params[:len(names)] == names, f"{module}.{qualname}{inspect.signature(obj)}"


@pytest.mark.parametrize(("module", "qualname", "needles"), SOURCE_PINS, ids=[f"{m}:{q}" for m, q, _ in SOURCE_PINS])
def test_source_pins(module: str, qualname: str, needles: list[str]) -> None:
    obj = _resolve(module, qualname)
    obj = getattr(obj, "__ray_actor_class__", obj)
    source = inspect.getsource(inspect.unwrap(obj))
    missing = [n for n in needles if n not in source]
    assert not missing, f"{module}.{qualname} no longer contains {missing}"


def test_ray_and_registry_hooks_exist() -> None:
    from verl.checkpoint_engine.base import CheckpointEngineManager
    from verl.single_controller.base.decorator import Dispatch
    from verl.trainer.main_ppo import TaskRunnerV1
    from verl.trainer.ppo.utils import Role

    assert inspect.isclass(TaskRunnerV1.__ray_actor_class__)  # type: ignore[attr-defined]
    assert {"run", "init_agent_loop_manager"} <= set(vars(TaskRunnerV1.__ray_actor_class__))  # type: ignore[attr-defined]
    assert Dispatch.ONE_TO_ALL is not None  # type: ignore[attr-defined]
    assert {"Actor", "ActorRollout", "ActorRolloutRef"} <= set(Role.__members__)
    for name in ("update_weights", "wake_up_replicas", "sleep_replicas"):
        assert inspect.iscoroutinefunction(getattr(CheckpointEngineManager, name).__wrapped__), name


def test_worker_subclass_is_bound_like_verls() -> None:
    import ray
    from verl.single_controller.base.decorator import MAGIC_ATTR
    from verl.single_controller.ray.base import RayClassWithInitArgs, create_colocated_worker_cls
    from verl.workers.engine_workers import ActorRolloutRefWorker

    from verl_speco.verl_integration.worker import SpecoActorRolloutRefWorker

    assert issubclass(SpecoActorRolloutRefWorker, ActorRolloutRefWorker)
    for method in ("compute_log_prob", "update_actor"):
        ours = getattr(getattr(SpecoActorRolloutRefWorker, method), MAGIC_ATTR)
        theirs = getattr(getattr(ActorRolloutRefWorker, method), MAGIC_ATTR)
        assert ours["execute_mode"] == theirs["execute_mode"] and ours["blocking"] == theirs["blocking"]
        assert ours["dispatch_mode"]["dispatch_fn"].args == theirs["dispatch_mode"]["dispatch_fn"].args  # "actor"
    for name in ("speco_init", "speco_end_step", "speco_close"):
        assert hasattr(getattr(SpecoActorRolloutRefWorker, name), MAGIC_ATTR), name
    fused = create_colocated_worker_cls({"actor_rollout": RayClassWithInitArgs(
        cls=ray.remote(SpecoActorRolloutRefWorker), config={}, role="actor_rollout")})
    methods = set(dir(fused.cls.__ray_actor_class__))
    assert {"actor_rollout_speco_end_step", "actor_rollout_speco_init", "actor_rollout_compute_log_prob",
            "actor_rollout_update_actor"} <= methods


@pytest.mark.parametrize("mode", ["sync", "colocate_async", "separate_async"])
def test_trainer_subclass_of_every_registered_trainer(mode: str) -> None:
    from verl.trainer.ppo.v1 import get_trainer_cls

    from verl_speco.verl_integration.trainer import VERL_PATCHES, SpecoTrainerMixin, speco_trainer_cls

    base = get_trainer_cls(mode)
    cls = speco_trainer_cls(base)
    assert issubclass(cls, base) and cls.__mro__[1] is SpecoTrainerMixin and speco_trainer_cls(base) is cls
    for name in ("_setup", "_init_resource_pool_mgr", "_compute_old_log_prob", "step", "_consume_sync_metrics"):
        assert getattr(cls, name) is getattr(SpecoTrainerMixin, name), name
    for name in VERL_PATCHES:  # every private verl method the adapter overrides exists on verl's trainer
        assert callable(getattr(base, name, None)) and getattr(cls, name) is getattr(SpecoTrainerMixin, name), name


def test_trainer_refuses_a_verl_release_its_patches_were_not_read_on(monkeypatch: pytest.MonkeyPatch) -> None:
    import verl
    from verl.trainer.ppo.v1 import get_trainer_cls

    from verl_speco.online.config import DrafterConfigError
    from verl_speco.verl_integration.trainer import VERL_RELEASES, speco_trainer_cls

    assert VERL_RELEASES == ("0.9.1",) and verl.__version__ == "0.9.1"
    monkeypatch.setattr(verl, "__version__", "0.9.2")
    with pytest.raises(DrafterConfigError, match=r"verl 0\.9\.2 is installed; SpecoTrainerMixin overrides verl's "
                                                 r"private trainer methods \['_compute_old_log_prob', .*\['0\.9\.1'\]"):
        speco_trainer_cls(get_trainer_cls("sync"))


def test_trainer_swaps_in_the_capture_worker_on_a_real_config() -> None:
    from verl.trainer.ppo.utils import Role
    from verl.trainer.ppo.v1 import get_trainer_cls

    from verl_speco.verl_integration.config_bridge import extract_drafter
    from verl_speco.verl_integration.trainer import speco_trainer_cls
    from verl_speco.verl_integration.worker import SpecoActorRolloutRefWorker

    cfg = compose(["actor_rollout_ref.rollout.drafter.enable=true", "data.train_files=none.parquet"])
    drafter = extract_drafter(cfg)  # the driver's one parse; the trainer takes it as it is
    trainer = speco_trainer_cls(get_trainer_cls("sync"))(cfg, drafter)
    assert trainer.speco is drafter and drafter.enable and "drafter" not in cfg.actor_rollout_ref.rollout
    trainer._init_resource_pool_mgr()
    (role,) = [r for r in trainer.role_worker_mapping if r in (Role.ActorRollout, Role.ActorRolloutRef)]
    assert trainer.role_worker_mapping[role].__ray_actor_class__ is SpecoActorRolloutRefWorker
    off_cfg = compose(["data.train_files=none.parquet"])
    off = speco_trainer_cls(get_trainer_cls("sync"))(off_cfg, extract_drafter(off_cfg))
    off._init_resource_pool_mgr()
    assert all(getattr(c, "__ray_actor_class__", None) is not SpecoActorRolloutRefWorker
               for c in off.role_worker_mapping.values())


class _Replica:
    """A rollout replica as the checkpoint manager sees it (verl's async replica API)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, tuple]] = []
        self.version = -1

    async def wake_up(self) -> None:
        self.calls.append(("wake_up", ()))

    async def resume_generation(self) -> None:
        self.calls.append(("resume_generation", ()))

    async def speco_call(self, method: str, args: tuple = ()) -> list[Any]:
        self.calls.append((method, tuple(args)))
        if method == "speco_load_draft":  # answered like DraftReloadMixin.speco_load_draft
            if str(args[0]).endswith("torn"):
                status = "rejected"
            else:
                status = "loaded" if int(args[1]) > self.version else "stale"
            if status == "loaded":
                self.version = int(args[1])
            answer = {"status": status, "version": self.version, "reason": "" if status == "loaded" else status}
            return [answer, answer]  # two engine workers (TP=2)
        if method == "speco_draft_digest":  # a draft kept across sleep (served_draft.py: nothing re-sent)
            digest = {"version": self.version, "digest": f"d{self.version}", "tensors": {"fc.weight": "x"}}
            return [digest, digest]
        return [self.version, self.version]


def _controller() -> Any:
    """The `OnlineController` whose publish bookkeeping the weight-sync hook reads and writes."""
    from verl_speco.online.config import DrafterRunConfig
    from verl_speco.online.controller import OnlineController

    no_drafter: Any = None  # the hook never reaches the drafter
    return OnlineController(DrafterRunConfig(enable=True, mode="online"), no_drafter)


def test_checkpoint_manager_reloads_the_latest_draft_after_every_wake_up() -> None:
    from verl.checkpoint_engine.base import CheckpointEngineManager
    from verl.workers.config.rollout import CheckpointEngineConfig

    from verl_speco.verl_integration.weight_sync import SpecoCheckpointEngineManager, weights_hook

    ctl = _controller()
    replicas = [_Replica(), _Replica()]
    manager = SpecoCheckpointEngineManager.wrap(
        CheckpointEngineManager(CheckpointEngineConfig(backend="naive"), actor_wg=None, replicas=replicas),
        weights_hook(ctl))

    def wake() -> list[list[str]]:
        for r in replicas:
            r.calls.clear()
        asyncio.run(manager.wake_up_replicas.__wrapped__(manager))
        return [[c[0] for c in r.calls] for r in replicas]

    assert wake() == [["wake_up", "speco_draft_version"]] * 2  # nothing published yet
    ctl.latest = {"version": 1, "path": "/shm/v000001"}
    loaded = ["wake_up", "speco_load_draft", "speco_draft_digest", "speco_draft_version"]
    checked = ["wake_up", "speco_draft_digest", "speco_draft_version"]  # still served: tests/verl/test_served_draft.py
    assert wake() == [loaded] * 2
    assert replicas[0].calls[1] == ("speco_load_draft", ("/shm/v000001", 1))
    assert wake() == [checked] * 2
    ctl.latest = {"version": 3, "path": "/shm/v000003"}
    wake()
    assert ctl.sync_metrics["drafter/served_version_min"] == 3.0
    # a publish the servers refuse (torn): they keep serving v3, it is counted and never offered again
    ctl.latest = {"version": 4, "path": "/shm/v000004-torn"}
    assert wake() == [["wake_up", "speco_load_draft", "speco_draft_version"]] * 2
    assert ctl.sync_metrics["drafter/publish_rejected_total"] == 1.0
    assert ctl.sync_metrics["drafter/served_version_min"] == 3.0
    assert wake() == [checked] * 2  # v3 still served
    ctl.latest = {"version": 5, "path": "/shm/v000005"}  # the next good publish loads
    wake()
    assert ctl.sync_metrics["drafter/served_version_min"] == 5.0
    assert ctl.sync_metrics["drafter/publish_rejected_total"] == 1.0
    replicas[1].version = 9  # a replica that already holds a newer draft: stale, counted, not fatal
    ctl.latest = {"version": 6, "path": "/shm/v000006"}
    wake()
    assert ctl.sync_metrics["drafter/publish_stale_total"] == 1.0


def test_draft_loads_before_generation_resumes_after_a_non_naive_sync() -> None:
    """verl's update_weights aborts generation, syncs, then resumes it (`resume_generation_replicas`);
    the draft is loaded in between, while nothing is in flight (the naive path has no abort/resume)."""
    import inspect

    from verl.checkpoint_engine.base import CheckpointEngineManager
    from verl.workers.config.rollout import CheckpointEngineConfig

    from verl_speco.verl_integration.weight_sync import SpecoCheckpointEngineManager, weights_hook

    source = inspect.getsource(CheckpointEngineManager.update_weights)
    naive, abort = source.index('if self.backend == "naive":'), source.index("await self.abort_replicas()")
    finalize, resume = source.index('["finalize"]'), source.index("await self.resume_generation_replicas()")
    assert naive < abort < finalize < resume
    ctl = _controller()
    ctl.latest = {"version": 2, "path": "/shm/v000002"}
    replicas = [_Replica(), _Replica()]
    manager = SpecoCheckpointEngineManager.wrap(
        CheckpointEngineManager(CheckpointEngineConfig(backend="naive"), actor_wg=None, replicas=replicas),
        weights_hook(ctl))
    asyncio.run(manager.resume_generation_replicas.__wrapped__(manager))
    assert [[c[0] for c in r.calls] for r in replicas] == [
        ["speco_load_draft", "speco_draft_digest", "speco_draft_version", "resume_generation"]] * 2


def test_vllm_server_classes_install_on_verls(vllm_alias: str) -> None:
    from verl.workers.rollout.replica import RolloutReplicaRegistry, get_rollout_replica_class
    from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension
    from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer, vLLMReplica

    from verl_speco.engines.vllm_reload import DraftReloadMixin
    from verl_speco.verl_integration import vllm_server
    from verl_speco.verl_integration.draft_servers import DRAFT_METHODS

    ext = vllm_server.SpecoWorkerExtension
    assert issubclass(ext, DraftReloadMixin) and issubclass(ext, vLLMColocateWorkerExtension)
    assert all(callable(getattr(ext, m)) for m in DRAFT_METHODS)
    qualname = vllm_server.SpecoVLLMHttpServer._get_worker_extension_cls(None)  # type: ignore[arg-type]
    module, _, name = qualname.rpartition(".")
    assert getattr(__import__(module, fromlist=[name]), name) is ext
    assert "self._get_worker_extension_cls()" in inspect.getsource(vLLMHttpServer.launch_server)
    assert "self.engine.collective_rpc(" in inspect.getsource(vLLMHttpServer.collective_rpc)
    assert "self.server_class = ray.remote(vLLMHttpServer)" in inspect.getsource(vLLMReplica.__init__)
    assert issubclass(vllm_server.SpecoVLLMReplica, vLLMReplica)
    saved = dict(RolloutReplicaRegistry._registry)
    try:
        vllm_server.install_replica_class()
        assert get_rollout_replica_class("vllm") is vllm_server.SpecoVLLMReplica
    finally:
        RolloutReplicaRegistry._registry.clear()
        RolloutReplicaRegistry._registry.update(saved)
    assert get_rollout_replica_class("vllm") is vLLMReplica


def test_sglang_server_classes_match_verls_source() -> None:
    """verl's SGLang server imports sglang (absent here): its source text is checked for what
    `draft_servers.SGLangDraftServerMixin` reads, and our loader is what verl's registry returns."""
    import importlib.util

    from verl.workers.rollout.replica import RolloutReplicaRegistry

    from verl_speco.verl_integration import draft_servers

    spec = importlib.util.find_spec("verl.workers.rollout.sglang_rollout.async_sglang_server")
    assert spec is not None and spec.origin is not None
    source = Path(spec.origin).read_text()
    for needle in ("class SGLangHttpServer:", "self.node_rank = node_rank", "def get_server_address(self):",
                   "return self._server_address, self._server_port", "self.config: RolloutConfig =",
                   "self.config.tensor_model_parallel_size", "if self.node_rank > 0:\n            return",
                   "await run_uvicorn(app, server_args, self._server_address)",
                   "class SGLangReplica(RolloutReplica):", "self.server_class = ray.remote(SGLangHttpServer)"):
        assert needle in source, needle
    saved = dict(RolloutReplicaRegistry._registry)
    try:
        draft_servers.install_sglang_replica_class()
        assert RolloutReplicaRegistry._registry["sglang"] is draft_servers._load_speco_sglang
    finally:
        RolloutReplicaRegistry._registry.clear()
        RolloutReplicaRegistry._registry.update(saved)
