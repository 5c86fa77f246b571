"""`--check`: a launcher's overrides through the configs' own validation, nothing started: verl stages
composed as `verl-speco` does and run through verl's `validate_config`, the family's settings and (online)
the engine arguments built; the trainer stage against its typed schema. Failures raise `LaunchCheckError`."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from verl_speco.launchers import recipes


class LaunchCheckError(ValueError):
    """A launcher's overrides do not compose or do not validate."""


def _config_error(err: Exception) -> bool:
    from verl_speco.online.config import DrafterConfigError
    from verl_speco.train.config import ConfigError

    return isinstance(err, DrafterConfigError | ConfigError | ValueError | KeyError) or \
        type(err).__module__.startswith(("hydra", "omegaconf"))


def check_verl(overrides: Sequence[str], device: str) -> dict[str, Any]:
    """Compose and validate a `verl-speco` command's overrides; returns the rollout engine kwargs the
    trainer would start the engine with (online) or {} (drafter off, collect_only)."""
    from omegaconf import OmegaConf

    from verl_speco.main import compose
    from verl_speco.verl_integration.config_bridge import (
        apply_speculative_config,
        prepare_config,
        rollout_engine,
    )

    try:
        cfg = compose(list(overrides))
        drafter = prepare_config(cfg)
        recipes.family_config(drafter.family, dict(drafter.settings))
        if not (drafter.enable and drafter.mode == "online"):
            return {}
        values = dict(drafter.settings)
        engine = rollout_engine(cfg)
        recipes.engine_speculative_args(drafter.family, engine, values, drafter.num_speculative_tokens, device)
        spec = recipes.CPU_PROBE if device == "cpu" else recipes.QWEN3_8B
        from drafters.registry import get_family

        family = get_family(drafter.family)
        fmt = family.engine_format(family.resolve(recipes.family_config(drafter.family, values), spec), spec)
        kwargs = apply_speculative_config(cfg, drafter, "<draft>", fmt)
    except Exception as err:  # noqa: BLE001 - every configuration error is reported the same way
        if not _config_error(err):
            raise
        raise LaunchCheckError(f"{type(err).__name__}: {err}") from err
    out = OmegaConf.to_container(OmegaConf.create(kwargs), resolve=True)
    assert isinstance(out, dict)
    return {str(k): v for k, v in out.items()}


def check_trainer(overrides: Sequence[str]) -> Any:
    """Compose and validate `verl-speco-draft-train` overrides; returns the TrainerConfig."""
    from verl_speco.train.compose import load_config

    try:
        cfg = load_config(list(overrides))
        recipes.family_config(cfg.drafter.family, dict(cfg.drafter.settings))
    except Exception as err:  # noqa: BLE001 - every configuration error is reported the same way
        if not _config_error(err):
            raise
        raise LaunchCheckError(f"{type(err).__name__}: {err}") from err
    return cfg
