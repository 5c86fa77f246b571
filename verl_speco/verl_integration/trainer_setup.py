"""What `SpecoTrainerMixin` does around verl's `_setup` (and refuses at construction): where the drafter's
rows come from, the drafter group and its `OnlineController` (online), the layer layout without a
drafter actor, the rollout engine's speculative config, and the kept copy of the initial draft."""

from __future__ import annotations

import tempfile
from typing import Any

import ray
from omegaconf import open_dict

from verl_speco.engines.sglang_capture import RolloutCapturePlan
from verl_speco.online.config import DrafterConfigError, DrafterRunConfig


def keep_baseline(version_dir: str) -> tuple[str, int]:
    """A copy of published version `version_dir` (`.../v000001`) that pruning never removes:
    `<publish root>/baseline/v000001`, complete or absent. Returns (its path, its version)."""
    import shutil
    from pathlib import Path

    src = Path(version_dir)
    dst = src.parent / "baseline" / src.name
    if not dst.is_dir():
        tmp = dst.with_name(dst.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.copytree(src, tmp)
        tmp.replace(dst)
    return str(dst), int(src.name[1:])


def local_layout(drafter: DrafterRunConfig, target_dir: str) -> tuple[list[int], dict[str, int]]:
    """Layer ids and target shape without a drafter actor (collect_only)."""
    spec, family, cfg = _resolved_family(drafter, target_dir)
    ids = [int(i) for i in family.required_layout(cfg, spec).layer_ids]
    return ids, {"hidden_size": int(spec.hidden_size), "vocab_size": int(spec.vocab_size)}


def installed(distribution: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return None


def speco_capture_source(drafter: DrafterRunConfig, engine: str, target_dir: str,
                         sglang_version: str | None) -> RolloutCapturePlan | None:
    """The rollout capture plan of this run, or None to capture from the actor
    (`online.rollout_capture.choose_capture_source`)."""
    if drafter.capture_source == "actor" or not drafter.enable or drafter.mode == "offline":
        return None
    from verl_speco.online.rollout_capture import choose_capture_source

    spec, family, fam_cfg = _resolved_family(drafter, target_dir)
    return choose_capture_source(drafter, engine, family, fam_cfg, spec, sglang_version)


def _resolved_family(drafter: DrafterRunConfig, target_dir: str) -> tuple[Any, Any, Any]:
    """(the target's spec, the drafter's family, its config from `drafter.settings` resolved on that target)."""
    from drafters.common.target import TargetSpec
    from drafters.registry import get_family
    from verl_speco.train.config import build_family_config

    spec = TargetSpec.from_pretrained(target_dir)
    family = get_family(drafter.family)
    return spec, family, family.resolve(build_family_config(family.config_cls, dict(drafter.settings), drafter.family), spec)


def check_trainer_config(config: Any, drafter: DrafterRunConfig) -> None:
    """What the drafter section cannot run with in this verl config, refused before anything starts."""
    active = bool(drafter.enable) and drafter.mode != "offline"
    if active and drafter.capture_pass == "old_logprob":
        rc = config.algorithm.get("rollout_correction", None)
        if rc is not None and rc.get("bypass_mode", False):
            raise DrafterConfigError("algorithm.rollout_correction.bypass_mode: got True, expected False with "
                                     "actor_rollout_ref.rollout.drafter.capture_pass=old_logprob (capture "
                                     "runs in the old-logprob pass, which bypass mode skips; "
                                     "capture_pass=post_update works with it)")
    if active and drafter.mode == "online":
        from verl_speco.verl_integration.fresh_samples import check_trainer_mode

        check_trainer_mode(drafter, str(config.trainer.v1.trainer_mode))


def target_dir(config: Any) -> str:
    """The target model's local directory (verl's `copy_to_local` of `actor_rollout_ref.model.path`)."""
    from verl.utils.fs import copy_to_local

    model = config.actor_rollout_ref.model
    return str(copy_to_local(str(model.path), use_shm=bool(model.get("use_shm", False))))


def before_verl_setup(t: Any) -> tuple[list[int], dict[str, int]]:
    """Before verl's `_setup`: the capture source and, online, the drafter group, initial draft, publish room,
    speculative config and replica class. Returns the capture layout (layer ids, target shape)."""
    from verl_speco.verl_integration.config_bridge import apply_speculative_config, rollout_engine

    config, drafter = t.config, t.speco
    target = target_dir(config)
    engine = rollout_engine(config)
    plan = speco_capture_source(drafter, engine, target, installed("sglang"))
    if plan is not None:
        from drafters.common.target import TargetSpec
        from verl_speco.verl_integration.rollout_rows import arm_rollout_capture

        hidden = int(TargetSpec.from_pretrained(target).hidden_size)
        t._speco_rollout = arm_rollout_capture(config, drafter, plan, hidden)
    if not t.speco_online:
        return local_layout(drafter, target)
    from drafters.registry import engine_format_from_dict
    from verl_speco.deploy.engine_check import require_engine_support
    from verl_speco.online.controller import OnlineController
    from verl_speco.online.publish import publish_dir_of
    from verl_speco.online.publish_room import require_publish_room
    from verl_speco.verl_integration import drafter_actor

    # before anything starts: an engine release that cannot serve the family, or (vLLM) one
    # the live draft reload was not checked against, is refused naming the release and why
    require_engine_support(engine, drafter.family, live_publish=True)
    if drafter.heldout_baseline and engine != "vllm":
        raise DrafterConfigError(f"actor_rollout_ref.rollout.drafter.heldout_baseline: got True with "
                                 f"rollout.name={engine}, expected rollout.name=vllm (SGLang reports no "
                                 "acceptance counters to compare the drafts with)")
    run_name = str(config.trainer.experiment_name)
    device_type = "npu" if str(config.trainer.get("device", "cuda")) == "npu" else "cuda"
    group = drafter_actor.start_drafter_group(drafter, target, run_name, device_type)
    t.speco_ctl = OnlineController(drafter, drafter_actor.RayDrafterLink(group))
    layer_ids, shape = ray.get(group.layer_ids.remote()), ray.get(group.target_shape.remote())
    draft_dir = drafter.model_path or ray.get(group.export_initial.remote(
        tempfile.mkdtemp(prefix="verl_speco_initial_draft_")))
    # before the engines start: room for the versions the run will publish (/dev/shm in a container)
    require_publish_room(publish_dir_of(drafter.publish_dir, run_name), draft_dir)
    apply_speculative_config(config, drafter, str(draft_dir),
                             engine_format_from_dict(ray.get(group.engine_format.remote())))
    if engine == "vllm":
        from verl_speco.verl_integration.vllm_server import install_replica_class

        install_replica_class()
        with open_dict(config.actor_rollout_ref.rollout):  # the acceptance counters need stats
            config.actor_rollout_ref.rollout.disable_log_stats = False
    else:  # sglang (rollout_engine admits only ENGINES)
        from verl_speco.verl_integration.draft_servers import install_sglang_replica_class

        install_sglang_replica_class()
    return layer_ids, shape


def after_verl_setup(t: Any, layer_ids: list[int], shape: dict[str, int]) -> None:
    """After verl's `_setup`: arm the capture and, online, wrap the checkpoint managers (`weight_sync`) and
    publish v1, the initial draft, so a re-apply always has a source."""
    model_path = str(t.config.actor_rollout_ref.model.path)
    if t._speco_rollout is None:  # the workers capture
        t.actor_rollout_wg.speco_init(layer_ids, shape["hidden_size"], shape["vocab_size"], model_path)
    elif not t.speco_online:  # the rollout's rows go to the store from here
        from verl_speco.verl_integration.rollout_rows import rollout_store_sink

        t._speco_sink = rollout_store_sink(t.speco, t._speco_rollout.plan, shape["hidden_size"],
                                           shape["vocab_size"], model_path)
    if not t.speco_online:
        return
    from verl_speco.verl_integration.weight_sync import wrap_managers

    wrap_managers(t, t.speco_ctl)
    t.speco_ctl.publish()
    if t.speco.fresh_samples:
        from verl_speco.verl_integration.fresh_samples import FreshPrompts

        t._speco_fresh = FreshPrompts(t.train_dataset, t.speco.fresh_samples, t.speco.seed)
    if t.speco.heldout_baseline and t.speco_ctl.latest is not None:
        t._speco_baseline = keep_baseline(str(t.speco_ctl.latest["path"]))
