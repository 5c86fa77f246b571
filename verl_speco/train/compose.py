"""Hydra composition of the trainer config from `configs/` into a validated `TrainerConfig`."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError

from verl_speco.train.config import ConfigError, TrainerConfig, register_schema, validate

DEFAULT_CONFIG_NAME = "draft_trainer"


def default_config_dir() -> Path:
    """`$VERL_SPECO_CONFIG_DIR`, else the repository's `configs/` next to the package."""
    env = os.environ.get("VERL_SPECO_CONFIG_DIR")
    return Path(env) if env else Path(__file__).resolve().parents[2] / "configs"


def compose_raw(overrides: Sequence[str] = (), config_name: str = DEFAULT_CONFIG_NAME,
                config_dir: str | Path | None = None) -> DictConfig:
    """Compose `config_name` from `config_dir` with Hydra overrides (`key=value`, `preset=...`)."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    register_schema()
    root = Path(config_dir) if config_dir is not None else default_config_dir()
    if not root.is_dir():
        raise FileNotFoundError(f"config dir {str(root)!r} does not exist (set --config-dir or "
                                "VERL_SPECO_CONFIG_DIR)")
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(root.resolve()), version_base=None):
            return compose(config_name=config_name, overrides=list(overrides))
    finally:
        GlobalHydra.instance().clear()


def to_trainer_config(raw: DictConfig) -> TrainerConfig:
    """Convert a composed config to the typed schema; missing mandatory keys fail by name."""
    missing = sorted(OmegaConf.missing_keys(raw))
    if missing:
        raise ValueError(f"mandatory trainer setting(s) not set: {missing} (pass e.g. "
                         f"{missing[0]}=... on the command line)")
    container = OmegaConf.to_container(raw, resolve=True)
    try:  # re-check against the schema: Hydra's `+key=value` appends keys even to structured configs
        checked = OmegaConf.merge(OmegaConf.structured(TrainerConfig), container)
    except ConfigKeyError as err:
        raise ConfigError(f"unknown trainer setting: {err}".splitlines()[0]
                          + " (see verl_speco/train/config.py for the schema)") from err
    obj = OmegaConf.to_object(checked)
    assert isinstance(obj, TrainerConfig)
    return validate(obj)


def load_config(overrides: Sequence[str] = (), config_name: str = DEFAULT_CONFIG_NAME,
                config_dir: str | Path | None = None) -> TrainerConfig:
    return to_trainer_config(compose_raw(overrides, config_name, config_dir))
