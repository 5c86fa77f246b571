"""verl_speco/capture/recipe.py, growing a store: a complete store whose prompts are the first lines of a
longer prompt file is linked into a new store and only the remaining prompts are collected."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from verl_speco.capture.collect import collect_features
from verl_speco.capture.recipe import collected_store, collection_recipe

SETTINGS = {"cap": 1, "seed": 0}


def _lines(path: Path, n: int) -> Path:
    path.write_text("".join(json.dumps({"row": i}) + "\n" for i in range(n)))
    return path


class FakeCollect:
    """Writes store.json once and one shard per call holding the prompt lines it was given."""

    def __init__(self) -> None:
        self.calls: list[tuple[Path, list[str]]] = []

    def __call__(self, store: Path, prompts: Path) -> dict[str, int]:
        rows = prompts.read_text().splitlines()
        (store / "shards").mkdir(parents=True, exist_ok=True)
        if not (store / "store.json").exists():
            (store / "store.json").write_text("{}")
        (store / "shards" / f"run{len(self.calls)}.safetensors").write_text("\n".join(rows))
        self.calls.append((store, rows))
        return {"rows": len(rows)}


def test_a_grown_store_links_the_base_and_collects_only_the_rest(tmp_path: Path) -> None:
    collect = FakeCollect()
    base = collected_store(tmp_path / "small", "train", _lines(tmp_path / "p3.jsonl", 3), SETTINGS, collect)
    (base / "shards" / ".tmp-inflight").write_text("x")     # a temporary is never linked
    prompts = _lines(tmp_path / "p5.jsonl", 5)
    grown = collected_store(tmp_path / "big", "train", prompts, SETTINGS, collect, grow_from=base)

    assert [rows for _, rows in collect.calls] == [[json.dumps({"row": i}) for i in range(3)],
                                                   [json.dumps({"row": 3}), json.dumps({"row": 4})]]
    assert sorted(p.name for p in (grown / "shards").iterdir()) == ["run0.safetensors", "run1.safetensors"]
    assert os.stat(grown / "shards" / "run0.safetensors").st_ino == os.stat(base / "shards" / "run0.safetensors").st_ino
    assert sorted(p.name for p in (base / "shards").iterdir()) == [".tmp-inflight", "run0.safetensors"]  # base untouched

    marker = json.loads((grown.parent / f"{grown.name}.done").read_text())
    base_digest = json.loads((base.parent / f"{base.name}.done").read_text())["digest"]
    assert marker["grown_from"] == base_digest and marker["base_rows"] == 3
    assert marker["summary"] == {"base": {"rows": 3}, "added": {"rows": 2}}
    # the grown store's name is its own: not that of the same prompts collected in one go
    assert grown.name == f"train-{collection_recipe(prompts, {**SETTINGS, 'grown_from': base_digest})['digest']}"
    assert grown.name != f"train-{collection_recipe(prompts, SETTINGS)['digest']}"
    assert collected_store(tmp_path / "big", "train", prompts, SETTINGS, collect, grow_from=base) == grown
    assert len(collect.calls) == 2                           # a complete grown store is reused

    again = collected_store(tmp_path / "bigger", "train", _lines(tmp_path / "p6.jsonl", 6), SETTINGS, collect,
                            grow_from=grown)                 # a grown store grows again
    assert collect.calls[-1][1] == [json.dumps({"row": 5})]
    assert sorted(p.name for p in (again / "shards").iterdir()) == [f"run{i}.safetensors" for i in range(3)]


def test_growth_is_refused_naming_what_differs(tmp_path: Path) -> None:
    collect = FakeCollect()
    base = collected_store(tmp_path / "small", "train", _lines(tmp_path / "p3.jsonl", 3), SETTINGS, collect)
    prompts = _lines(tmp_path / "p5.jsonl", 5)
    with pytest.raises(ValueError, match=r"its cap is 1, this collection's is 2"):
        collected_store(tmp_path / "big", "train", prompts, {**SETTINGS, "cap": 2}, collect, grow_from=base)
    with pytest.raises(ValueError, match=r"its engine is None, this collection's is 'vllm'"):
        collected_store(tmp_path / "big", "train", prompts, {**SETTINGS, "engine": "vllm"}, collect, grow_from=base)
    other = tmp_path / "other.jsonl"
    other.write_text("".join(json.dumps({"row": -i}) + "\n" for i in range(5)))
    with pytest.raises(ValueError, match=r"are not the first lines of .*other.jsonl"):
        collected_store(tmp_path / "big", "train", other, SETTINGS, collect, grow_from=base)
    with pytest.raises(ValueError, match=r"it holds every prompt .* \(3 lines\); nothing to grow"):
        collected_store(tmp_path / "big", "train", tmp_path / "p3.jsonl", SETTINGS, collect, grow_from=base)
    (base.parent / f"{base.name}.done").unlink()             # planted: the base is a stopped collection
    with pytest.raises(ValueError, match=r"expected a complete collected store"):
        collected_store(tmp_path / "big", "train", prompts, SETTINGS, collect, grow_from=base)
    assert len(collect.calls) == 1 and not (tmp_path / "big").exists()  # nothing was collected or created


def test_a_grown_real_store_reads_back_as_the_whole_prompt_file(target_dir: Path, tmp_path: Path) -> None:
    """collect_features into a grown store: a second writer run beside the linked base. Read back with
    checksums on, it holds every prompt's sample, equal to those of the same file collected in one go."""
    from feature_store import StoreReader

    from .test_collect import _chats

    chats = _chats()
    full = tmp_path / "full.jsonl"
    full.write_text("".join(json.dumps({"messages": c}) + "\n" for c in chats))
    head = tmp_path / "head.jsonl"
    head.write_text("".join(json.dumps({"messages": c}) + "\n" for c in chats[:4]))
    settings = {"layout_of": "eagle1"}

    def collect(store: Path, prompts: Path) -> dict[str, int]:
        s = collect_features(target_dir, prompts, store, families="eagle1", batch_size=2, dtype="float32")
        return {"samples": s.samples}

    base = collected_store(tmp_path / "a", "train", head, settings, collect)
    grown = collected_store(tmp_path / "b", "train", full, settings, collect, grow_from=base)
    whole = collected_store(tmp_path / "c", "train", full, settings, collect)

    def read(root: Path) -> dict[tuple[int, ...], dict[str, torch.Tensor]]:
        with StoreReader(root, seed=0, shuffle=False, prefetch=0, copy=True, verify_checksums=True) as reader:
            it = reader.iter_samples()
            return {tuple(s["input_ids"].tolist()): s for s in (next(it) for _ in range(len(reader)))}

    got, ref = read(grown), read(whole)
    assert len(ref) == len(chats) and got.keys() == ref.keys()
    assert len(read(base)) == 4                              # the base still reads as before
    for ids, sample in got.items():
        assert torch.equal(sample["loss_mask"], ref[ids]["loss_mask"])
        torch.testing.assert_close(sample["last_hidden"], ref[ids]["last_hidden"])
    commits = sorted(p.name for p in (grown / "shards").glob("*.commit.json"))
    assert len({name.split("-")[1] for name in commits}) == 2  # two writer runs: the base's and the growth's
