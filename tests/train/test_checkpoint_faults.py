"""Crash safety of checkpoints and of metrics.jsonl, through the real trainer entry.

A kill can land anywhere in a save: the checkpoint under its final name `step_<N>` must then be
either the complete old one, the complete new one, or absent, and `run.resume=true` must fall back
to the newest complete checkpoint (with a warning naming what it skipped). A torn last line of
metrics.jsonl (power loss, full disk) must not block the resume.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from conftest import overrides
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from verl_speco.train import entry
from verl_speco.train.checkpoint import (
    CheckpointError,
    list_checkpoints,
    load_checkpoint,
    resolve_resume,
    save_checkpoint,
)
from verl_speco.train.metrics_log import is_timing_metric, read_jsonl


def _train(*args: str) -> None:
    assert entry.main(list(args)) == 0


def _records(out: Path, kind: str) -> list[dict]:
    return [{k: v for k, v in r.items() if not is_timing_metric(k)} for r in read_jsonl(out / "metrics.jsonl", kind)]


def _same_weights(a: Path, b: Path) -> bool:
    ta, tb = load_file(str(a)), load_file(str(b))
    return ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)


@pytest.fixture(scope="module")
def reference(tiny_target: Path, tiny_store: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """6 uninterrupted steps (checkpoints at 3 and 6)."""
    out = tmp_path_factory.mktemp("reference")
    _train(*overrides(tiny_target, tiny_store, out))
    return out


@pytest.fixture(scope="module")
def interrupted(tiny_target: Path, tiny_store: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same run stopped after step 4 (complete checkpoints step_3 and step_4)."""
    out = tmp_path_factory.mktemp("interrupted")
    _train(*overrides(tiny_target, tiny_store, out), "run.stop_after=4")
    assert [p.name for p in list_checkpoints(out / "ckpt")] == ["step_3", "step_4"]
    return out


def _resume_and_compare(reference: Path, out: Path, tiny_target: Path, tiny_store: Path) -> None:
    _train(*overrides(tiny_target, tiny_store, out), "run.resume=true")
    for kind in ("train", "eval"):
        assert _records(out, kind) == _records(reference, kind)  # bit-exact continuation
    for name in ("model.safetensors", "optimizer.safetensors"):
        assert _same_weights(reference / "ckpt/step_6/trainer" / name, out / "ckpt/step_6/trainer" / name)


@pytest.mark.parametrize("damage", ["partial_files", "no_marker"])
def test_resume_skips_a_torn_checkpoint(damage: str, reference: Path, interrupted: Path, tiny_target: Path,
                                        tiny_store: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    shutil.copytree(interrupted, out)
    torn = out / "ckpt" / "step_4"
    if damage == "partial_files":  # what a kill inside a delete or a write leaves: some files gone or short
        (torn / "trainer" / "optimizer.safetensors").unlink()
        shutil.rmtree(torn / "export")
        weights = torn / "trainer" / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    else:  # every file there, but the completion marker (written last) is not
        (torn / "complete.json").unlink(missing_ok=True)
    with pytest.warns(UserWarning, match=r"step_4.*incomplete"):
        _resume_and_compare(reference, out, tiny_target, tiny_store)
    assert [p.name for p in list_checkpoints(out / "ckpt")] == ["step_3", "step_6"]  # step_4 stays skipped
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an incomplete dir older than the newest complete one is not news
        assert resolve_resume(True, out / "ckpt") == out / "ckpt" / "step_6"


@pytest.mark.parametrize("tail", [b'{"step": 5, "kind": "train", "lo', b"\0" * 64])
def test_resume_repairs_a_torn_last_metrics_line(tail: bytes, reference: Path, interrupted: Path,
                                                 tiny_target: Path, tiny_store: Path, tmp_path: Path) -> None:
    out = tmp_path / "run"
    shutil.copytree(interrupted, out)
    with open(out / "metrics.jsonl", "ab") as f:  # a record cut short / a tail of zeros after power loss
        f.write(tail)
    with pytest.warns(UserWarning, match="metrics.jsonl"):
        _resume_and_compare(reference, out, tiny_target, tiny_store)
    text = (out / "metrics.jsonl").read_text()
    assert text.endswith("\n") and "\0" not in text
    assert all(json.loads(line)["step"] <= 6 for line in text.splitlines())


def test_explicit_resume_of_an_incomplete_checkpoint_is_rejected(interrupted: Path, tmp_path: Path) -> None:
    ck = tmp_path / "step_3"
    shutil.copytree(interrupted / "ckpt" / "step_3", ck)
    (ck / "trainer" / "optimizer.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"run\.resume=.*step_3.*optimizer\.safetensors"):
        resolve_resume(str(ck), tmp_path)


# -- kill at every filesystem operation of a save ---------------------------------------------------


class Killed(BaseException):
    """The process died here (not an Exception: nothing may catch it)."""


@pytest.fixture()
def group(tmp_path: Path) -> Iterator[None]:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _model() -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    return model, opt


def _export(full: dict[str, Tensor], out: Path) -> None:
    out.mkdir(parents=True)
    save_file(dict(full), str(out / "model.safetensors"))


def _save(root: Path, step: int, tag: str, keep_last: int = 0) -> Path:
    model, opt = _model()
    return save_checkpoint(root, step, model, opt, {"position": step}, {"tag": tag}, _export, keep_last)


def _kill_at(monkeypatch: pytest.MonkeyPatch, kill_at: int) -> list[int]:
    """Count renames and tree deletions; die at operation `kill_at` (a deletion dies half way)."""
    count = [0]
    real_replace, real_rename, real_rmtree = os.replace, os.rename, shutil.rmtree

    def tick() -> bool:
        count[0] += 1
        return count[0] - 1 == kill_at

    def replace(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        if tick():
            raise Killed
        real_replace(src, dst)

    def rename(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
        if tick():
            raise Killed
        real_rename(src, dst)

    def rmtree(path: str | os.PathLike[str], ignore_errors: bool = False, **kw: object) -> None:
        if tick():
            files = sorted(p for p in Path(path).rglob("*") if p.is_file())
            for p in files[: (len(files) + 1) // 2]:
                p.unlink()
            raise Killed
        real_rmtree(path, ignore_errors=ignore_errors)

    monkeypatch.setattr(os, "replace", replace)
    monkeypatch.setattr(os, "rename", rename)
    monkeypatch.setattr(shutil, "rmtree", rmtree)
    return count


@pytest.mark.parametrize("scenario", ["overwrite", "prune"])
def test_a_kill_anywhere_in_a_save_leaves_only_complete_checkpoints(scenario: str, group: None, tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """overwrite: step_2 is saved again over an existing step_2; prune: step_3 with keep_last=1."""
    base = tmp_path / "base"
    _save(base, 1, "old")
    _save(base, 2, "old")
    step, keep = (2, 0) if scenario == "overwrite" else (3, 1)
    clean = shutil.copytree(base, tmp_path / "clean")
    with monkeypatch.context() as m:  # how many operations a clean save does
        ops = _kill_at(m, -1)
        _save(clean, step, "new", keep)
        total = ops[0]
    assert total >= 2
    for kill_at in range(total):
        root = shutil.copytree(base, tmp_path / f"kill{kill_at}")
        with monkeypatch.context() as m:
            _kill_at(m, kill_at)
            with pytest.raises(Killed):
                _save(root, step, "new", keep)
        found = list_checkpoints(root)
        assert found, f"kill at operation {kill_at}: no complete checkpoint left"
        for path in found:  # everything listed loads, and is one of the saves, whole
            model, opt = _model()
            state = load_checkpoint(path, model, opt)
            assert state["tag"] in ("old", "new") and state["step"] == int(path.name.split("_")[1])
            assert state["reader"] == {"position": state["step"]}
        newest = resolve_resume(True, root)
        assert newest is not None and newest in found
        _save(root, step, "new", keep)  # the next save cleans up whatever the kill left
        names = sorted(p.name for p in root.iterdir())
        assert names == (["step_1", "step_2"] if scenario == "overwrite" else ["step_3"]), (kill_at, names)
        assert json.loads((root / f"step_{step}" / "trainer" / "state.json").read_text())["tag"] == "new"
