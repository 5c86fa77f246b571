"""verl_speco/capture/recipe.py: a collected store is named by its recipe and reused only for it."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from verl_speco.capture.recipe import collected_store, collection_recipe


def test_recipe_digest_is_over_the_prompt_bytes_and_settings(tmp_path: Path) -> None:
    prompts = tmp_path / "train.jsonl"
    prompts.write_bytes(b'{"messages": []}\n')
    recipe = collection_recipe(prompts, {"max_new_tokens": 64, "seed": 0})
    # computed another way: the SHA-256 of the sorted JSON of everything but the digest, 12 hex digits
    body = {"max_new_tokens": 64, "prompts_sha256": hashlib.sha256(prompts.read_bytes()).hexdigest(), "seed": 0}
    assert recipe["digest"] == hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:12]
    assert collection_recipe(prompts, {"seed": 0, "max_new_tokens": 64})["digest"] == recipe["digest"]
    assert collection_recipe(prompts, {"max_new_tokens": 65, "seed": 0})["digest"] != recipe["digest"]
    prompts.write_bytes(b'{"messages": []}\n{"messages": []}\n')
    assert collection_recipe(prompts, {"max_new_tokens": 64, "seed": 0})["digest"] != recipe["digest"]


def test_a_store_is_collected_once_per_recipe_and_a_stopped_one_again(tmp_path: Path) -> None:
    prompts = tmp_path / "train.jsonl"
    prompts.write_text("{}\n")
    seen: list[Path] = []

    def collect(store: Path, data: Path) -> dict[str, int]:
        assert not store.exists() and data == prompts
        store.mkdir()
        (store / "shard").write_text(str(len(seen)))
        seen.append(store)
        return {"rows": len(seen)}

    first = collected_store(tmp_path / "stores", "train", prompts, {"cap": 1}, collect)
    assert collected_store(tmp_path / "stores", "train", prompts, {"cap": 1}, collect) == first and len(seen) == 1
    marker = json.loads((first.parent / f"{first.name}.done").read_text())
    assert marker["cap"] == 1 and marker["summary"] == {"rows": 1} and first.name == f"train-{marker['digest']}"
    other = collected_store(tmp_path / "stores", "train", prompts, {"cap": 2}, collect)
    assert other != first and (first / "shard").read_text() == "0"  # the first store is kept
    (first.parent / f"{first.name}.done").unlink()  # planted: a collection stopped before its marker
    assert collected_store(tmp_path / "stores", "train", prompts, {"cap": 1}, collect) == first
    assert (first / "shard").read_text() == "2" and len(seen) == 3

    def fail(store: Path, data: Path) -> None:
        store.mkdir()
        raise RuntimeError("engine died")

    with pytest.raises(RuntimeError, match="engine died"):
        collected_store(tmp_path / "stores", "train", prompts, {"cap": 3}, fail)
    assert len(list((tmp_path / "stores").glob("train-*.done"))) == 2  # the two earlier markers stay; none for the failed recipe
