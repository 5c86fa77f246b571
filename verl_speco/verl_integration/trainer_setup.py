"""What `SpecoTrainerMixin._setup` decides before verl starts: where the drafter's rows come from, the
layer layout without a drafter actor, and the kept copy of the initial draft."""

from __future__ import annotations

from typing import Any

from verl_speco.engines.sglang_capture import RolloutCapturePlan
from verl_speco.online.config import DrafterRunConfig


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
    """The rollout capture plan of this verl run, or None to capture from the actor; decided before
    anything starts (`online.rollout_capture.choose_capture_source`: a family or setting the rollout
    cannot serve is refused under `rollout`, falls back with a log line under `auto`)."""
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
