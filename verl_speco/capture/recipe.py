"""A collected store named by its recipe: reused only when the same recipe asks for it again.

Applications that collect once and reuse the result (the quickstart, the family benchmark) name the
store `<name>-<digest>`, the digest covering the prompt file's bytes and every collection setting,
so other settings collect a new store instead of silently training on the old one. A `.done` marker
(the recipe as JSON and what `collect` returned) is written once collection returns; a directory
without it is what a stopped collection left, and is removed first.

Growing (`grow_from`): a complete store whose prompt file is the first lines of this one, with the
same settings, is linked in and only the remaining prompts are collected. The base's digest enters
the recipe (`grown_from`), so a grown store (same prompts, other shard order) never takes the name of
one collected in one go."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from feature_store.store import TMP_PREFIX  # in-flight temporaries: never linked into a grown store

DIGEST_CHARS = 12
MARKER_KEYS = ("prompts_sha256", "digest", "summary", "grown_from", "base_rows")  # a marker's keys that are not settings

Collect = Callable[[Path, Path], Mapping[str, Any] | None]  # (store directory, prompt file) -> summary


def collection_recipe(prompts: str | Path, settings: Mapping[str, Any]) -> dict[str, Any]:
    """{"prompts_sha256", **settings, "digest"}: the digest is over the sorted JSON of the rest."""
    recipe: dict[str, Any] = {"prompts_sha256": hashlib.sha256(Path(prompts).read_bytes()).hexdigest(), **settings}
    recipe["digest"] = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:DIGEST_CHARS]
    return recipe


def built_once(directory: str | Path, build: Callable[[Path], Mapping[str, Any] | None],
               record: Mapping[str, Any]) -> Path:
    """`directory`, built by `build(directory)` unless its `<directory>.done` marker is there. The marker
    (`record` plus `"summary"`, what `build` returned, as JSON) is written only after `build` returns, so
    a directory without it is what a stopped build left: it is removed and built again."""
    directory = Path(directory)
    done = directory.parent / f"{directory.name}.done"
    if not done.exists():
        if directory.exists():
            shutil.rmtree(directory)
        directory.parent.mkdir(parents=True, exist_ok=True)
        summary = build(directory)
        done.write_text(json.dumps({**record, "summary": dict(summary or {})}, indent=1))
    return directory


def collected_store(parent: str | Path, name: str, prompts: str | Path, settings: Mapping[str, Any],
                    collect: Collect, grow_from: str | Path | None = None) -> Path:
    """The store `parent/<name>-<digest>` of this recipe, collected by `collect(store, prompts)` unless a
    complete one (its `.done` marker written) is already there. With `grow_from` (a complete store of
    the same settings whose prompts are this file's first lines) only the remaining prompts are
    collected, into a store that starts as the base's files (module docstring)."""
    prompts = Path(prompts)
    if grow_from is None:
        recipe = collection_recipe(prompts, settings)
        return built_once(Path(parent) / f"{name}-{recipe['digest']}", lambda store: collect(store, prompts), recipe)
    base = Path(grow_from)
    marker, rows, rest = _growth(base, prompts, settings)
    recipe = {**collection_recipe(prompts, {**settings, "grown_from": marker["digest"]}), "base_rows": rows}

    def grow(store: Path) -> dict[str, Any]:
        link_tree(base, store)
        remaining = store.parent / f"{store.name}.rest.jsonl"
        remaining.write_bytes(rest)
        return {"base": marker["summary"], "added": dict(collect(store, remaining) or {})}

    return built_once(Path(parent) / f"{name}-{recipe['digest']}", grow, recipe)


def _growth(base: Path, prompts: Path, settings: Mapping[str, Any]) -> tuple[dict[str, Any], int, bytes]:
    """(the base's marker, its prompt lines, the bytes of this file's remaining lines), or ValueError
    naming what stops `base` from growing into this collection."""
    done = base.parent / f"{base.name}.done"
    if not base.is_dir() or not done.is_file():
        raise ValueError(f"grow_from={base}: expected a complete collected store (a directory with its "
                         f"{done.name} marker beside it)")
    marker = json.loads(done.read_text())
    base_settings = {k: v for k, v in marker.items() if k not in MARKER_KEYS}
    for key in sorted(set(base_settings) | set(settings)):
        if base_settings.get(key) != settings.get(key):
            raise ValueError(f"grow_from={base}: its {key} is {base_settings.get(key)!r}, this collection's is "
                             f"{settings.get(key)!r}; a store grows only under the same settings")
    data = prompts.read_bytes()
    digest, rows, end = hashlib.sha256(), 0, 0
    for line in data.splitlines(keepends=True):
        digest.update(line)
        rows, end = rows + 1, end + len(line)
        if digest.copy().hexdigest() == marker["prompts_sha256"]:
            if end == len(data):
                raise ValueError(f"grow_from={base}: it holds every prompt of {prompts} ({rows} lines); "
                                 "nothing to grow: collect without grow_from")
            return marker, rows, data[end:]
    raise ValueError(f"grow_from={base}: its prompts (sha256 {marker['prompts_sha256'][:12]}...) are not the first "
                     f"lines of {prompts}; expected a prompt file that extends the base's")


def link_tree(source: Path, dest: Path) -> None:
    """Give `dest` every file of `source` (a store: store.json and its shards), hard-linked where the
    file system allows (shards are never rewritten in place) and copied where it does not; in-flight
    temporaries are skipped."""
    for path in sorted(source.rglob("*")):
        target = dest / path.relative_to(source)
        if path.is_dir():
            target.mkdir(parents=True, exist_ok=True)
        elif not path.name.startswith(TMP_PREFIX):
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(path, target)
            except OSError:
                shutil.copy2(path, target)
