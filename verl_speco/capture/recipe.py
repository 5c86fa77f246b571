"""A collected store named by its recipe: reused only when the same recipe asks for it again.

Applications that collect once and reuse the result (the quickstart, the family benchmark) name the
store directory `<name>-<digest>`, where the digest covers the prompt file's bytes and every setting
the collection depends on. Another --train-prompts, response cap or seed then collects a new store
beside the old one instead of silently training on the old one.

Worked example: `collected_store(out / "stores", "train", prompts, {"max_new_tokens": 64}, collect)`
returns `out/stores/train-1f0c...` (12 hex digits) and writes `out/stores/train-1f0c....done` (the
recipe as JSON, plus what `collect` returned) once `collect(store)` has returned; a directory found
without its `.done` marker is what a stopped collection left, and is removed before collecting again.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

DIGEST_CHARS = 12


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
                    collect: Callable[[Path], Mapping[str, Any] | None]) -> Path:
    """The store `parent/<name>-<digest>` of this recipe, collected by `collect(store)` unless a
    complete one (its `.done` marker written) is already there."""
    recipe = collection_recipe(prompts, settings)
    return built_once(Path(parent) / f"{name}-{recipe['digest']}", collect, recipe)
