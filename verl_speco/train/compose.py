"""Hydra composition of the trainer config from `configs/` into a validated `TrainerConfig`.

`load_config` reports every composition problem as one `ConfigError` line naming the setting, the
value given and what the schema expects (`compose_raw` leaves Hydra's own exceptions alone)."""

from __future__ import annotations

import dataclasses
import os
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import ConfigKeyError, OmegaConfBaseException

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
        raise ConfigError(f"mandatory trainer setting(s) {', '.join(missing)} not set: expected "
                          f"{missing[0]}=... on the command line")
    container = OmegaConf.to_container(raw, resolve=True)
    try:  # re-check against the schema: Hydra's `+key=value` appends keys even to structured configs
        checked = OmegaConf.merge(OmegaConf.structured(TrainerConfig), container)
    except ConfigKeyError as err:
        raise ConfigError(_unknown_key(str(err.full_key), None)) from err
    obj = OmegaConf.to_object(checked)
    assert isinstance(obj, TrainerConfig)
    return validate(obj)


def load_config(overrides: Sequence[str] = (), config_name: str = DEFAULT_CONFIG_NAME,
                config_dir: str | Path | None = None) -> TrainerConfig:
    from hydra.errors import HydraException

    try:
        raw = compose_raw(overrides, config_name, config_dir)
    except FileNotFoundError as err:
        raise ConfigError(f"--config-dir: {err}") from err
    except HydraException as err:
        raise ConfigError(_hydra_message(err, overrides)) from err
    return to_trainer_config(raw)


# -- messages ---------------------------------------------------------------------------------------------

_TYPE_NAMES: dict[Any, str] = {float: "a float", int: "an integer", bool: "true or false", str: "a string",
                               Any: "any value"}


def _describe(tp: Any) -> str:
    """A schema type in words: `int | None` -> "an integer or null", `list[float]` -> "a list of floats"."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        words = " or ".join(_describe(a) for a in args if a is not type(None))
        return words + (" or null" if type(None) in args else "")
    if typing.get_origin(tp) is list:
        return f"a list of {_describe(args[0]).removeprefix('a ').removeprefix('an ')}s" if args else "a list"
    if typing.get_origin(tp) is dict:
        return "a mapping"
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return f"a {tp.__name__} section"
    return _TYPE_NAMES.get(tp, getattr(tp, "__name__", str(tp)))


def _schema_type(full_key: str) -> Any:
    """The declared type of `full_key` in `TrainerConfig` (None when the schema does not type it)."""
    node: Any = TrainerConfig
    for part in full_key.split("."):
        if not dataclasses.is_dataclass(node):
            return None
        hints = typing.get_type_hints(node)
        if part not in hints:
            return None
        node = hints[part]
    return node


def _given(full_key: str, overrides: Sequence[str]) -> str:
    """`key=value` as given on the command line (the key alone when no override names it)."""
    for o in overrides:
        key, sep, _ = o.lstrip("+~").partition("=")
        if sep and (key == full_key or key.startswith(full_key + ".")):
            return o.lstrip("+~")
    return full_key


def _unknown_key(full_key: str, given: str | None) -> str:
    parent, _, _ = full_key.rpartition(".")
    section = _schema_type(parent) if parent else TrainerConfig
    where = f"unknown trainer setting {given or full_key!r}"
    if dataclasses.is_dataclass(section):
        keys = ", ".join(f"{parent}.{f.name}" if parent else f.name for f in dataclasses.fields(section))
        return f"{where}: expected one of {keys} (schema: verl_speco/train/config.py)"
    return (f"{where}: {parent} has no key {full_key.rsplit('.', 1)[-1]!r} in the composed config; expected "
            f"+{full_key}=... to add one (the family's config class then checks it)")


def _hydra_message(err: Exception, overrides: Sequence[str]) -> str:
    from hydra.errors import MissingConfigException

    cause = err.__cause__
    if isinstance(cause, OmegaConfBaseException) and cause.full_key:
        full_key = str(cause.full_key)
        if isinstance(cause, (ConfigKeyError, AttributeError)):
            return _unknown_key(full_key, _given(full_key, overrides))
        tp = _schema_type(full_key)
        detail = str(cause.msg).splitlines()[0]
        expected = _describe(tp) if tp is not None else "a valid value"
        return f"{full_key}={cause.value!r}: expected {expected} ({detail})"
    if isinstance(err, MissingConfigException) and err.missing_cfg_file:
        group, _, name = str(err.missing_cfg_file).rpartition("/")
        if group and err.options:
            return f"{group}={name}: no such config; expected one of {', '.join(err.options)}"
        return f"--config-name {name!r}: no {name}.yaml in the config dir"
    lines = [line.strip() for line in str(err).split("Config search path")[0].splitlines() if line.strip()]
    return ": ".join(lines) + " (overrides are key=value, see verl_speco/train/config.py)"
