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


def collected_store(parent: str | Path, name: str, prompts: str | Path, settings: Mapping[str, Any],
                    collect: Callable[[Path], Mapping[str, Any] | None]) -> Path:
    """The store `parent/<name>-<digest>` of this recipe, collected by `collect(store)` unless a
    complete one (its `.done` marker written) is already there."""
    recipe = collection_recipe(prompts, settings)
    store = Path(parent) / f"{name}-{recipe['digest']}"
    done = store.parent / f"{store.name}.done"
    if not done.exists():
        if store.exists():
            shutil.rmtree(store)  # a collection stopped part way: never marked done
        store.parent.mkdir(parents=True, exist_ok=True)
        summary = collect(store)
        done.write_text(json.dumps({**recipe, "summary": dict(summary or {})}, indent=1))
    return store
