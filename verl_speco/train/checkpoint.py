"""Checkpoints: engine-ready export + exact trainer state, written atomically, no pickle.

`<out_dir>/ckpt/step_<N>/` holds `export/` (the engine-ready drafter export(s)), `trainer/` (full
weights, AdamW state, per-rank RNG and data cursors, `state.json`) and `complete.json`, written last
(a step without it, or whose files differ from it, is never resumed from). Nothing under a final name
is ever written into or partially deleted: saves and prunes go through `*.tmp` / `*.old` renames, so
a kill leaves the previous complete checkpoint to resume from. The file-by-file layout:
docs/design/formats.md section 3. All ranks must see the same filesystem."""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file
from torch import Tensor, nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from verl_speco.train.rng import capture_rng, restore_rng

_STEP_DIR = re.compile(r"^step_(\d+)$")
_LEFTOVER = re.compile(r"^step_\d+\.(tmp|old)$")
MARKER = "complete.json"
MARKER_FORMAT = "verl-speco-checkpoint"
ExportFn = Callable[[dict[str, Tensor], Path], None]


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used to resume this run."""


class IncompleteCheckpointWarning(UserWarning):
    """`run.resume=true` skipped a `step_<N>` directory that is not a complete checkpoint."""


def _fsync_dir(d: Path) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(root: Path) -> None:
    for path in sorted(root.rglob("*")):
        if path.is_file():
            with open(path, "rb") as f:
                os.fsync(f.fileno())
    for d in [root, *[p for p in root.rglob("*") if p.is_dir()], root.parent]:
        _fsync_dir(d)


def _write_marker(tmp: Path, step: int, world: int) -> None:
    """The completion marker, written (and made durable) after every other file is."""
    files = {p.relative_to(tmp).as_posix(): p.stat().st_size for p in sorted(tmp.rglob("*")) if p.is_file()}
    marker = tmp / MARKER
    _write_json(marker, {"format": MARKER_FORMAT, "step": step, "world_size": world, "files": files})
    with open(marker, "rb") as f:
        os.fsync(f.fileno())
    _fsync_dir(tmp)


def _remove(path: Path) -> None:
    """Delete a checkpoint directory so that no partial state is ever left under its name."""
    aside = path.with_name(path.name + ".old")
    shutil.rmtree(aside, ignore_errors=True)
    os.replace(path, aside)
    _fsync_dir(path.parent)
    shutil.rmtree(aside, ignore_errors=True)


def checkpoint_problem(path: Path) -> str | None:
    """None when `path` is a complete checkpoint, else why not (names the missing or short file)."""
    marker = path / MARKER
    if not marker.is_file():
        return f"no {MARKER} (the save did not finish)"
    try:
        meta = json.loads(marker.read_text())
        files = dict(meta["files"]) if meta.get("format") == MARKER_FORMAT else None
    except (ValueError, KeyError, TypeError) as err:
        return f"{MARKER} is unreadable ({err})"
    if files is None:
        return f"{MARKER} is not a {MARKER_FORMAT} marker"
    for rel, size in sorted(files.items()):
        f = path / rel
        if not f.is_file():
            return f"{rel} is missing"
        if f.stat().st_size != size:
            return f"{rel} has {f.stat().st_size} bytes, {MARKER} says {size}"
    return None


def _write_json(path: Path, obj: Any) -> None:
    path.write_text(json.dumps(obj, indent=1, sort_keys=True))


def _trainable_names(model: nn.Module) -> set[str]:
    """State-dict keys of the trainer state: trainable parameters + persistent buffers."""
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    return set(model.state_dict()) - frozen


def flatten_optimizer_state(osd: dict[str, Any]) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """{"state": {fqn: {k: v}}, "param_groups": [...]} -> (tensors "<fqn>/<k>", json rest)."""
    tensors: dict[str, Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for fqn, entry in osd["state"].items():
        for key, value in entry.items():
            if isinstance(value, Tensor):
                tensors[f"{fqn}/{key}"] = value.detach().cpu().contiguous()
            else:
                scalars.setdefault(fqn, {})[key] = value
    groups = [{k: (list(v) if isinstance(v, tuple) else v) for k, v in g.items()} for g in osd["param_groups"]]
    return tensors, {"param_groups": groups, "scalars": scalars}


def unflatten_optimizer_state(tensors: dict[str, Tensor], meta: dict[str, Any]) -> dict[str, Any]:
    state: dict[str, dict[str, Any]] = {fqn: dict(v) for fqn, v in meta["scalars"].items()}
    for name, value in tensors.items():
        fqn, key = name.rsplit("/", 1)
        state.setdefault(fqn, {})[key] = value
    groups = [{k: (tuple(v) if k == "betas" else v) for k, v in g.items()} for g in meta["param_groups"]]
    return {"state": state, "param_groups": groups}


def save_checkpoint(ckpt_root: Path, step: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                    reader_state: dict[str, Any], trainer_state: dict[str, Any],
                    export_fn: ExportFn, keep_last: int = 0) -> Path:
    """Collective: every rank calls it. Returns the final `step_<N>` directory."""
    rank, world = dist.get_rank(), dist.get_world_size()
    final, tmp = ckpt_root / f"step_{step}", ckpt_root / f"step_{step}.tmp"
    if rank == 0:
        ckpt_root.mkdir(parents=True, exist_ok=True)
        for leftover in [p for p in ckpt_root.iterdir() if _LEFTOVER.match(p.name)]:  # of an interrupted save
            shutil.rmtree(leftover, ignore_errors=True)
        (tmp / "trainer").mkdir(parents=True)
    dist.barrier()
    full = cast(dict[str, Tensor],
                get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)))
    osd = get_optimizer_state_dict(model, optimizer,
                                   options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    rng_tensors, rng_meta = capture_rng()
    save_file(rng_tensors, str(tmp / "trainer" / f"rng_rank{rank}.safetensors"))
    _write_json(tmp / "trainer" / f"rng_rank{rank}.json", rng_meta)
    _write_json(tmp / "trainer" / f"reader_rank{rank}.json", reader_state)
    if rank == 0:
        keep = _trainable_names(model)
        save_file({k: v.contiguous() for k, v in full.items() if k in keep},
                  str(tmp / "trainer" / "model.safetensors"))
        opt_tensors, opt_meta = flatten_optimizer_state(osd)
        save_file(opt_tensors, str(tmp / "trainer" / "optimizer.safetensors"))
        _write_json(tmp / "trainer" / "optimizer.json", opt_meta)
        _write_json(tmp / "trainer" / "state.json", {**trainer_state, "step": step, "world_size": world})
        export_fn(full, tmp / "export")
    del full, osd
    dist.barrier()
    if rank == 0:
        _fsync_tree(tmp)
        _write_marker(tmp, step, world)
        aside = ckpt_root / f"step_{step}.old"
        if final.exists():  # the old checkpoint stays whole (under another name) until the new one is in
            os.replace(final, aside)
        os.replace(tmp, final)
        _fsync_dir(ckpt_root)
        shutil.rmtree(aside, ignore_errors=True)
        if keep_last > 0:
            for old in list_checkpoints(ckpt_root)[:-keep_last]:
                _remove(old)
    dist.barrier()
    return final


def _step(path: Path) -> int:
    return int(path.name.removeprefix("step_"))


def _step_dirs(ckpt_root: Path) -> list[Path]:
    if not ckpt_root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in ckpt_root.iterdir() if p.is_dir() and (m := _STEP_DIR.match(p.name))]
    return [p for _, p in sorted(found)]


def list_checkpoints(ckpt_root: Path) -> list[Path]:
    """Complete checkpoints (`step_<N>` dirs whose marker matches their files), oldest first."""
    return [p for p in _step_dirs(ckpt_root) if checkpoint_problem(p) is None]


def incomplete_checkpoints(ckpt_root: Path) -> list[tuple[Path, str]]:
    """`step_<N>` dirs that are not complete checkpoints, with the reason, oldest first."""
    return [(p, problem) for p in _step_dirs(ckpt_root) if (problem := checkpoint_problem(p)) is not None]


def resolve_resume(resume: bool | str, ckpt_root: Path, warn: bool = True) -> Path | None:
    """`run.resume`: false -> None; true -> the newest complete checkpoint (None if none), warning
    (`IncompleteCheckpointWarning`, when `warn`) about every newer incomplete `step_<N>` it skips;
    a path -> it, when it is a complete checkpoint."""
    if resume is False:
        return None
    if resume is True:
        found = list_checkpoints(ckpt_root)
        newest = found[-1] if found else None
        instead = f"resuming from {newest.name}" if newest else "no complete checkpoint: starting fresh"
        for torn, why in incomplete_checkpoints(ckpt_root) if warn else []:
            if newest is None or _step(torn) > _step(newest):
                warnings.warn(f"run.resume=true: skipping {torn}: incomplete checkpoint ({why}); {instead}",
                              IncompleteCheckpointWarning, stacklevel=2)
        return newest
    path = Path(resume)
    problem = checkpoint_problem(path) if path.is_dir() else "no such directory"
    if problem is not None:
        raise CheckpointError(f"run.resume={resume!r}: not a complete checkpoint ({problem}); expected a "
                              f"<run.out_dir>/ckpt/step_<N> directory, or true for the newest one")
    return path


def check_fresh_out_dir(out_dir: Path, overwrite: bool) -> None:
    """A fresh run must not mix with an earlier run's checkpoints (resume=true would pick them)."""
    found = list_checkpoints(out_dir / "ckpt")
    if found and not overwrite:
        raise CheckpointError(f"run.out_dir={str(out_dir)!r} already holds checkpoints ({found[-1].name}); "
                              "pass run.resume=true to continue, run.overwrite=true to start over, or "
                              "another run.out_dir")


def clear_checkpoints(ckpt_root: Path) -> None:
    """Rank 0 of a fresh run with run.overwrite=true: the whole `ckpt/` goes, aside first."""
    if ckpt_root.is_dir():
        _remove(ckpt_root)


def load_checkpoint(path: Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """Collective. Restores weights, optimizer and this rank's RNG; returns state.json plus the
    rank's reader state under "reader"."""
    rank, world = dist.get_rank(), dist.get_world_size()
    trainer = path / "trainer"
    state: dict[str, Any] = json.loads((trainer / "state.json").read_text())
    if state["world_size"] != world:
        raise CheckpointError(f"{path}: saved with world_size={state['world_size']}, this run has "
                              f"world_size={world}; exact resume needs the same number of processes")
    weights = load_file(str(trainer / "model.safetensors"))
    expected = _trainable_names(model)
    if set(weights) != expected:
        raise CheckpointError(f"{path}: weights {sorted(set(weights) ^ expected)[:8]} differ between "
                              "the checkpoint and the model built from this config")
    set_model_state_dict(model, cast(dict[str, Any], weights),
                         options=StateDictOptions(full_state_dict=True, strict=False))
    osd = unflatten_optimizer_state(load_file(str(trainer / "optimizer.safetensors")),
                                    json.loads((trainer / "optimizer.json").read_text()))
    set_optimizer_state_dict(model, optimizer, osd, options=StateDictOptions(full_state_dict=True))
    restore_rng(load_file(str(trainer / f"rng_rank{rank}.safetensors")),
                json.loads((trainer / f"rng_rank{rank}.json").read_text()))
    state["reader"] = json.loads((trainer / f"reader_rank{rank}.json").read_text())
    return state
