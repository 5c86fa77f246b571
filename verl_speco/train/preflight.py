"""Checks of the trainer's inputs before any process group, model or torchrun exists, and the CLI's
one-line error report.

`check_inputs(cfg, world_size)` looks at what the config names the cheap way (the target's
config.json and weight files, the store's store.json, layout and commit records, the resume
checkpoint's completion marker) and raises `ConfigError` / `CheckpointError` naming the setting,
the value and what was expected. `verl-speco-draft-train` runs it once before starting torchrun;
every trainer process runs it again (cheap) before training. `USER_ERRORS` are the exception types
the CLI reports as `verl-speco-draft-train: error: <message>` with exit status 2; anything else is
a bug and keeps its traceback."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from drafters import get_family
from drafters.common.target import TargetLoadError, TargetSpec
from drafters.registry import RegistryError
from feature_store import StoreError
from feature_store.layout_select import select_layout
from feature_store.store import list_commits, load_store
from verl_speco.train import checkpoint as ckpt
from verl_speco.train.config import ConfigError, TrainerConfig, build_family_config
from verl_speco.train.data import store_fields, train_shard_set

PROG = "verl-speco-draft-train"
USER_ERRORS: tuple[type[BaseException], ...] = (ConfigError, ckpt.CheckpointError, TargetLoadError, StoreError)
_WEIGHTS = ("model.safetensors", "model.safetensors.index.json")


def report(err: BaseException, rank: str | None = None) -> int:
    """Print the error as one line on stderr (prefixed with the rank, when given); returns 2."""
    where = f"rank {rank}: " if rank is not None else ""
    print(f"{PROG}: error: {where}{' '.join(str(err).split())}", file=sys.stderr, flush=True)
    return 2


def check_inputs(cfg: TrainerConfig, world_size: int) -> None:
    """Raise a `USER_ERRORS` exception naming the first unusable setting (see the module doc)."""
    try:
        family = get_family(cfg.drafter.family)
    except RegistryError as err:
        raise ConfigError(f"drafter.family={cfg.drafter.family!r}: {err}") from err
    fam_cfg = build_family_config(family.config_cls, dict(cfg.drafter.settings), cfg.drafter.family)
    spec = check_target(cfg.target.path)
    try:
        layout = family.required_layout(fam_cfg, spec)
    except ValueError as err:
        raise ConfigError(f"drafter.settings={dict(cfg.drafter.settings)!r} for target.path={cfg.target.path!r}: "
                          f"{err}") from err
    fields = tuple(family.required_fields(fam_cfg))
    check_store("data.store", cfg.data.store, layout, fields)
    if cfg.data.eval_store is not None:
        check_store("data.eval_store", cfg.data.eval_store, layout, fields)
    train_shard_set(cfg.data)  # data.eval_fraction against the store's shards
    check_resume(cfg, world_size)


def check_target(path: str) -> TargetSpec:
    """The target's sizes, after checking `path` holds an HF model (config.json + weights)."""
    expected = "expected an HF model directory (config.json + model.safetensors or a sharded index)"
    root = Path(path)
    if not root.is_dir():
        raise ConfigError(f"target.path={path!r}: no such directory; {expected}")
    try:
        spec = TargetSpec.from_pretrained(root)
    except (TargetLoadError, ValueError) as err:  # ValueError: config.json is not JSON
        raise ConfigError(f"target.path={path!r}: not a model ({err}); {expected}") from err
    if not any((root / name).is_file() for name in _WEIGHTS):
        raise ConfigError(f"target.path={path!r}: no {' or '.join(_WEIGHTS)}; {expected}")
    return spec


def check_store(key: str, path: str, layout: Any, fields: tuple[str, ...]) -> None:
    """`path` is a Feature Store with committed shards, whose layout serves `layout` (the same layer
    ids or more, `select_layout`), holding `fields`."""
    try:
        meta = load_store(path)
        select_layout(meta.schema.layout, layout)
        meta.schema.check_fields(store_fields(fields, layout))
    except StoreError as err:
        raise ConfigError(f"{key}={path!r}: {err}") from err
    if not list_commits(path):
        raise ConfigError(f"{key}={path!r}: no committed shard; expected a store holding samples "
                          "(written by verl-speco-collect or feature_store.StoreWriter)")


def check_resume(cfg: TrainerConfig, world_size: int) -> None:
    """`run.resume` names a complete checkpoint of `world_size` processes, or a fresh run does not
    mix with the checkpoints already in `run.out_dir`."""
    out_dir = Path(cfg.run.out_dir)
    path = ckpt.resolve_resume(cfg.run.resume, out_dir / "ckpt", warn=False)
    if path is None:
        ckpt.check_fresh_out_dir(out_dir, cfg.run.overwrite)
        return
    saved = json.loads((path / ckpt.MARKER).read_text())["world_size"]
    if saved != world_size:
        raise ckpt.CheckpointError(f"run.resume={cfg.run.resume!r}: {path} was saved by {saved} process(es), this "
                                   f"run has {world_size}; expected the same number (exact resume)")
