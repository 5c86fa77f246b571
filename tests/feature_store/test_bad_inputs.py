"""Every bad input gives its documented error (reader/writer) and exit code (inspector), and loses
nothing committed: missing store.json, foreign / truncated shards, a flipped byte, schema drift,
non-finite values, empty masks, out-of-vocab ids, another layout, bad samples."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from conftest import LAYOUT, make_sample, make_schema, read_uids, write_store
from safetensors.torch import save_file

from feature_store import (
    ChecksumError,
    CorruptShardError,
    EmptyMaskError,
    EmptyStoreError,
    FieldSpec,
    Layout,
    LayoutMismatchError,
    NonFiniteError,
    SampleError,
    SchemaDriftError,
    SchemaError,
    StoreNotFoundError,
    StoreReader,
    StoreWriter,
    TokenIdError,
)
from feature_store.inspect import main as inspect_main
from feature_store.store import SHARDS_DIR, STORE_JSON, list_commits


def inspect_json(root: Path, *args: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, dict]:
    capsys.readouterr()
    code = inspect_main([str(root), "--json", *args])
    return code, json.loads(capsys.readouterr().out)


def kinds(report: dict) -> set[str]:
    return {e["kind"] for e in report["errors"]}


def shard_path(root: Path, k: int = 2) -> Path:
    return root / SHARDS_DIR / list_commits(root)[k].shard


def test_missing_store_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(StoreNotFoundError, match="no store.json"):
        StoreReader(tmp_path)
    code, rep = inspect_json(tmp_path, capsys=capsys)
    assert code == 2 and rep["usable"] is False and "no store.json" in rep["error"]
    assert inspect_main([str(tmp_path / "nowhere")]) == 2


def test_garbage_store_json_is_unusable(store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    (store / STORE_JSON).write_text("{not json")
    with pytest.raises(SchemaError, match="unreadable store.json"):
        StoreReader(store)
    assert inspect_main([str(store)]) == 2


def test_bad_arguments_exit_2(store: Path) -> None:
    assert inspect_main([str(store), "--no-such-flag"]) == 2
    assert inspect_main([str(store), "--max-samples", "-3"]) == 2
    assert inspect_main([str(store), "--max-samples", "many"]) == 2
    assert inspect_main([]) == 2


def test_foreign_shard_behind_a_commit(store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = shard_path(store)
    size = path.stat().st_size
    path.unlink()
    path.write_bytes(os.urandom(size))                       # same size, not a shard
    with pytest.raises(CorruptShardError, match="not a valid shard"):
        read_uids(store)
    code, rep = inspect_json(store, capsys=capsys)
    assert code == 1 and kinds(rep) == {"bad_shard"}


def test_foreign_safetensors_behind_a_commit(store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = shard_path(store)
    path.unlink()
    save_file({"weight": torch.zeros(3, 3)}, str(path))     # a valid safetensors file from elsewhere
    with pytest.raises(CorruptShardError):
        StoreReader(store)                                  # the size no longer matches the commit record
    code, rep = inspect_json(store, capsys=capsys)
    assert code == 1 and kinds(rep) == {"truncated"}


def test_uncommitted_foreign_file_is_invisible_but_reported(store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    save_file({"weight": torch.zeros(3, 3)}, str(store / SHARDS_DIR / "r00000-deadbeef-00000000.safetensors"))
    (store / SHARDS_DIR / ".tmp-r00009-x-00000000.safetensors").write_bytes(b"partial")
    assert sorted(read_uids(store)) == list(range(50))
    code, rep = inspect_json(store, capsys=capsys)
    assert code == 0 and {w["kind"] for w in rep["warnings"]} == {"uncommitted_shard", "uncommitted_temp"}
    assert inspect_main([str(store), "--strict"]) == 1


def test_truncated_shard(store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = shard_path(store)
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size - 100)
    with pytest.raises(CorruptShardError, match=r"bytes on disk, commit record says \d+ \(truncated"):
        StoreReader(store)
    code, rep = inspect_json(store, capsys=capsys)
    assert code == 1 and kinds(rep) == {"truncated"}


def test_flipped_byte_caught_by_checksum(store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = shard_path(store)
    data = bytearray(path.read_bytes())
    data[-10] ^= 0x01                                         # one bit of the last tensor's data
    path.unlink()
    path.write_bytes(bytes(data))
    assert len(read_uids(store)) == 50                        # undetectable without verification (documented)
    with pytest.raises(ChecksumError, match=r"checksum s64x4k:[0-9a-f]{32}, commit record says s64x4k:"):
        read_uids(store, verify_checksums=True)
    assert inspect_main([str(store)]) == 0
    code, rep = inspect_json(store, "--verify-checksums", capsys=capsys)
    assert code == 1 and kinds(rep) == {"checksum"}


def test_corrupt_commit_record(store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    commit = shard_path(store).with_name(list_commits(store)[2].name + ".commit.json")
    commit.unlink()
    commit.write_text('{"format": "verl-speco-feature-store", "shard": ')
    with pytest.raises(CorruptShardError, match="unreadable commit record"):
        StoreReader(store)
    code, rep = inspect_json(store, capsys=capsys)
    assert code == 1 and kinds(rep) == {"bad_commit"}


def test_schema_drift_between_writers(store: Path) -> None:
    before = sorted(read_uids(store))
    with pytest.raises(SchemaDriftError, match=r"field 'aux_hidden' dtype: 'bfloat16' vs 'float16'"):
        StoreWriter(store, make_schema("float16"))
    other_layout = make_schema(layout=Layout((1, 2, 3)))
    with pytest.raises(SchemaDriftError, match=r"layout: .*'layer_ids': \[2, 4, 5\].* vs .*\[1, 2, 3\]"):
        StoreWriter(store, other_layout)
    assert sorted(read_uids(store)) == before


def test_shard_from_another_schema_is_drift(tmp_path: Path, store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    other = tmp_path / "other"
    with StoreWriter(other, make_schema("float16")) as w:
        w.add(make_sample(1, schema=make_schema("float16")), step=0)
    rec = list_commits(other)[0]
    for suffix in (".safetensors", ".commit.json"):           # graft a foreign commit into the store
        (store / SHARDS_DIR / (rec.name + suffix)).write_bytes((other / SHARDS_DIR / (rec.name + suffix)).read_bytes())
    with pytest.raises(SchemaDriftError, match="committed with schema hash"):
        StoreReader(store)
    code, rep = inspect_json(store, capsys=capsys)
    assert code == 1 and kinds(rep) == {"schema_drift"}


@pytest.mark.parametrize(("field", "corrupt", "error", "kind", "message"), [
    ("aux_hidden", lambda t: t.index_fill_(0, torch.tensor([0]), float("nan")), NonFiniteError, "non_finite",
     r"field 'aux_hidden': 24 non-finite value\(s\) \(NaN/inf\), first at row 0"),
    ("last_hidden", lambda t: t.fill_(float("inf")), NonFiniteError, "non_finite", "field 'last_hidden'"),
    ("loss_mask", lambda t: t.zero_(), EmptyMaskError, "empty_mask", "field 'loss_mask': mask has no 1"),
    ("loss_mask", lambda t: t.fill_(2), EmptyMaskError, "bad_mask", r"field .loss_mask.: mask values in \[2, 2\], expected 0/1"),
    ("input_ids", lambda t: t.fill_(1000), TokenIdError, "token_id", r"field .input_ids.: token id\(s\) in \[1000, 1000\], expected \[0, 1000\)"),
    ("target_topk_ids", lambda t: t.fill_(-1), TokenIdError, "token_id", "field 'target_topk_ids'"),
])
def test_bad_values(tmp_path: Path, capsys: pytest.CaptureFixture[str], field: str, corrupt: object,
                    error: type[Exception], kind: str, message: str) -> None:
    bad = make_sample(7)
    corrupt(bad[field])  # type: ignore[operator]
    with StoreWriter(tmp_path / "a", make_schema(), flush_samples=3) as w:
        for u in range(5):
            w.add(make_sample(u), step=0)
        with pytest.raises(error, match=message):
            w.add(bad, step=0)
        assert w.buffered_samples == 2                        # nothing of the bad sample was buffered
        w.add(make_sample(5), step=0)
    assert read_uids(tmp_path / "a") == list(range(6))        # nothing committed was lost
    with StoreWriter(tmp_path / "b", make_schema(), check_values=False) as w:   # let it through, then detect
        w.add(make_sample(1), step=0)
        w.add(bad, step=0)
    code, rep = inspect_json(tmp_path / "b", capsys=capsys)
    assert code == 1 and kinds(rep) == {kind} and rep["errors"][0]["where"].endswith("[1]")
    reader = StoreReader(tmp_path / "b", shuffle=False, check_values=True, prefetch=2)
    it = reader.iter_samples()
    assert int(next(it)["uid"]) == 1
    with pytest.raises(error, match=r"\.safetensors\[1\]: " + message):
        next(it)


def test_bad_samples_name_field_expected_found(tmp_path: Path) -> None:
    w = StoreWriter(tmp_path, make_schema())
    cases = []
    s = make_sample(1)
    del s["reward"]
    cases.append((s, r"missing \['reward'\], unknown \[\]"))
    s = make_sample(1)
    s["extra"] = torch.zeros(1)
    cases.append((s, r"missing \[\], unknown \['extra'\]"))
    s = make_sample(1)
    s["aux_hidden"] = s["aux_hidden"][:, :10]
    cases.append((s, r"field 'aux_hidden': shape \[\d+, 10\], expected \['T', 24\]"))
    s = make_sample(1)
    s["last_hidden"] = s["last_hidden"][:-1]
    cases.append((s, r"field 'last_hidden': length \d+, field 'input_ids' has \d+"))
    s = make_sample(1)
    s["reward"] = torch.zeros(3, dtype=torch.float64)
    cases.append((s, r"field 'reward': shape \[3\], expected \[2\]"))
    s = make_sample(1)
    s["uid"] = 5
    cases.append((s, "field 'uid': int, expected a torch.Tensor"))
    for sample, msg in cases:
        with pytest.raises(SampleError, match=msg):
            w.add(sample, step=0)
    s = {k: (v[:0] if v.dim() and k not in ("reward",) else v) for k, v in make_sample(1).items()}
    with pytest.raises(SampleError, match="sample has 0 tokens"):
        w.add(s, step=0)
    with pytest.raises(SampleError, match="step='3': expected an int"):
        w.add(make_sample(1), step="3")  # type: ignore[arg-type]
    assert w.buffered_samples == 0


def test_store_for_another_layout(store: Path) -> None:
    with pytest.raises(LayoutMismatchError, match=r"layer_ids: store has \[2, 4, 5\], expected \[3, 6, 9\]"):
        StoreReader(store, expect_layout=Layout((3, 6, 9)))
    with pytest.raises(LayoutMismatchError, match="last_hidden: store has 'post_norm', expected 'pre_norm'"):
        StoreReader(store, expect_layout=Layout((2, 4, 5), last_hidden="pre_norm"))
    with pytest.raises(SchemaError, match="field 'dflash_hidden': expected by the reader, missing from the store"):
        StoreReader(store, expect_layout=LAYOUT, expect_fields=["input_ids", "dflash_hidden"])
    with pytest.raises(SchemaError, match="field 'aux_hidden': store has .*bfloat16.*, expected .*float32"):
        StoreReader(store, expect_fields=[FieldSpec("aux_hidden", "float32", (24,))])
    assert len(StoreReader(store, expect_layout=LAYOUT, expect_fields=["input_ids", "aux_hidden"])) == 50


def test_empty_store_and_empty_partition(tmp_path: Path) -> None:
    StoreWriter(tmp_path / "e", make_schema()).close()
    with pytest.raises(EmptyStoreError, match="no committed samples"):
        StoreReader(tmp_path / "e")
    write_store(tmp_path / "two", [1, 2])
    with pytest.raises(EmptyStoreError, match="use remainder='wrap'"):
        StoreReader(tmp_path / "two", rank=2, world_size=3)
    assert len(StoreReader(tmp_path / "two", rank=2, world_size=3, remainder="wrap")) == 1
