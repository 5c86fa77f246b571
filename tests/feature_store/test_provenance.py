"""Shards whose commit record is not their own, and shards committed twice (issue 9, item 6).

Each case is forged the way a bad tool or an attacker would do it, on a store of the real writer: a
committed shard copied (or moved) to another ``<writer id>-<seq>`` name, with a commit record that is the
original's rewritten for the new name (writer id, rank, run id, seq), so byte size, counts and checksum all
still match the bytes. The shard's header keeps the writer id and seq it was written with; the inspector
reports the disagreement and the reader refuses the store, and nothing valid is lost (removing the forged
files gives back exactly the original store).
"""

from __future__ import annotations

import json
import struct
from dataclasses import replace
from itertools import islice
from pathlib import Path

import pytest
import torch
from conftest import LAYOUT, read_uids

from feature_store import CommitRecord, CorruptShardError, FieldSpec, Schema, StoreReader, StoreWriter
from feature_store.checksum import file_checksum
from feature_store.inspect import main as inspect_main
from feature_store.store import COMMIT_SUFFIX, SHARDS_DIR, list_commits
from feature_store.writer import lead_field

FORGED = "r00001-deadbeef"


def relabel(data: bytes, writer_id: str, seq: int) -> bytes:
    """The shard ``data`` with its header's writer id and seq replaced, same header length (space padded)."""
    (hlen,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8: 8 + hlen])
    header["__metadata__"].update(writer_id=writer_id, seq=str(seq))
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= hlen
    return data[:8] + text + b" " * (hlen - len(text)) + data[8 + hlen:]


def forge(store: Path, k: int, writer_id: str, seq: int, *, move: bool = False,
          relabel_header: bool = False) -> tuple[CommitRecord, CommitRecord]:
    """Copy committed shard ``k`` to ``<writer_id>-<seq>`` with a consistent commit record; returns
    (original, forged) records. ``move`` removes the original; ``relabel_header`` also rewrites the shard
    header to the new writer id and seq (and the record's checksum to the new bytes)."""
    d = store / SHARDS_DIR
    rec = list_commits(store)[k]
    new = replace(rec, shard=f"{writer_id}-{seq:08d}.safetensors", writer_id=writer_id, rank=int(writer_id[1:6]),
                  run_id=writer_id[7:], seq=seq)
    data = (d / rec.shard).read_bytes()
    if relabel_header:
        data = relabel(data, writer_id, seq)
    (d / new.shard).write_bytes(data)
    new = replace(new, checksum=file_checksum(d / new.shard))
    (d / (new.name + COMMIT_SUFFIX)).write_bytes(new.to_json())
    if move:
        (d / rec.shard).unlink()
        (d / (rec.name + COMMIT_SUFFIX)).unlink()
    return rec, new


def unforge(store: Path, rec: CommitRecord) -> None:
    (store / SHARDS_DIR / rec.shard).unlink()
    (store / SHARDS_DIR / (rec.name + COMMIT_SUFFIX)).unlink()


def inspect_json(root: Path, *args: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, list[dict]]:
    capsys.readouterr()
    code = inspect_main([str(root), "--json", "--max-samples", "0", *args])
    return code, json.loads(capsys.readouterr().out)["errors"]


def test_copy_under_another_writer_id(store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    orig, forged = forge(store, 2, FORGED, 0)
    assert forged.checksum == orig.checksum                   # byte for byte the same file
    code, errors = inspect_json(store, "--strict", "--verify-checksums", capsys=capsys)
    assert code == 1
    assert sorted(e["kind"] for e in errors) == ["duplicate_content", "header_mismatch"]
    mismatch = next(e for e in errors if e["kind"] == "header_mismatch")
    assert mismatch["where"] == f"{SHARDS_DIR}/{forged.shard}"
    assert (f"header writer_id {orig.writer_id!r}, commit record says {FORGED!r}; "
            f"header seq '2', commit record says 0") in mismatch["message"]
    dup = next(e for e in errors if e["kind"] == "duplicate_content")
    assert dup["where"] == f"{SHARDS_DIR}/{forged.shard}" and orig.shard in dup["message"]
    code, errors = inspect_json(store, capsys=capsys)        # found without reading the tensor bytes too
    assert code == 1 and sorted(e["kind"] for e in errors) == ["duplicate_content", "header_mismatch"]
    dup = next(e for e in errors if e["kind"] == "duplicate_content")
    assert dup["message"].startswith(f"same checksum as {SHARDS_DIR}/{orig.shard} in its commit record")
    for verify in (False, True):                             # refused before any sample is read
        with pytest.raises(CorruptShardError, match=rf"{forged.shard}: header writer_id '{orig.writer_id}', "
                                                    rf"commit record says '{FORGED}'"):
            StoreReader(store, verify_checksums=verify)
    unforge(store, forged)
    assert read_uids(store, verify_checksums=True) == list(range(50))       # nothing committed was lost
    assert inspect_main([str(store), "--strict", "--verify-checksums"]) == 0


@pytest.mark.parametrize("move", [True, False])
def test_mismatched_sequence_number(store: Path, capsys: pytest.CaptureFixture[str], move: bool) -> None:
    orig, forged = forge(store, 3, list_commits(store)[3].writer_id, 11, move=move)
    code, errors = inspect_json(store, "--verify-checksums", capsys=capsys)
    assert code == 1
    assert sorted(e["kind"] for e in errors) == ([] if move else ["duplicate_content"]) + ["header_mismatch"]
    mismatch = next(e for e in errors if e["kind"] == "header_mismatch")
    assert mismatch["where"] == f"{SHARDS_DIR}/{forged.shard}"
    assert mismatch["message"].startswith("header seq '3', commit record says 11 ")
    with pytest.raises(CorruptShardError, match=rf"{forged.shard}: header seq '3', commit record says 11 "):
        StoreReader(store)


@pytest.mark.parametrize("edit", ["shard", "rank"])
def test_commit_record_of_another_name(store: Path, capsys: pytest.CaptureFixture[str], edit: str) -> None:
    """A tool that renames the files and edits only part of the record: the record's writer id and seq
    no longer give its shard's name (or its rank and run id no longer give its writer id)."""
    orig, forged = forge(store, 1, FORGED, 0)
    path = store / SHARDS_DIR / (forged.name + COMMIT_SUFFIX)
    bad = replace(orig, shard=forged.shard) if edit == "shard" else replace(forged, rank=3)
    path.unlink()
    path.write_bytes(bad.to_json())
    want = (rf"writer_id '{orig.writer_id}' and seq 1 give shard '{orig.shard}', the record is for '{forged.shard}'"
            if edit == "shard" else rf"writer_id '{FORGED}', expected 'r00003-deadbeef' \(from rank 3 and run_id")
    with pytest.raises(CorruptShardError, match=want):
        StoreReader(store)
    code, errors = inspect_json(store, capsys=capsys)
    assert code == 1 and [e["kind"] for e in errors] == ["bad_commit"]
    assert errors[0]["where"] == f"{SHARDS_DIR}/{forged.name}{COMMIT_SUFFIX}"


def test_same_tensors_under_a_relabelled_header(store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Header and record agree, the bytes differ (so does the checksum), the tensors are the original's."""
    orig, forged = forge(store, 4, FORGED, 0, relabel_header=True)
    assert forged.checksum != orig.checksum and forged.nbytes == orig.nbytes
    assert inspect_main([str(store), "--strict"]) == 0        # documented: needs the bytes (--verify-checksums)
    code, errors = inspect_json(store, "--verify-checksums", capsys=capsys)
    assert code == 1 and [e["kind"] for e in errors] == ["duplicate_content"]
    assert errors[0]["where"] == f"{SHARDS_DIR}/{forged.shard}"
    assert f"same tensors as {SHARDS_DIR}/{orig.shard}" in errors[0]["message"]
    reader = StoreReader(store, seed=5, verify_checksums=True, prefetch=2)
    seen: list[int] = []
    with pytest.raises(CorruptShardError, match=r"same tensors as .*(read twice|refusing)") as info:
        for sample in islice(reader.iter_samples(), len(reader)):
            seen.append(int(sample["uid"]))
    reader.close()
    assert orig.shard in str(info.value) and forged.shard in str(info.value)
    assert len(seen) == len(set(seen)) and len(seen) < len(reader)   # stopped before any uid came twice
    assert len(read_uids(store)) == 57       # documented: without verify_checksums the bytes are not read
    unforge(store, forged)
    assert read_uids(store, verify_checksums=True) == list(range(50))


def test_same_tensors_in_the_plain_layout(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A schema without a streamed lead field: the header is padded to 8 bytes only (``write_shard``), so the
    tensors start off a checksum sector; the content check must not depend on that."""
    schema = Schema((FieldSpec("input_ids", "int32"), FieldSpec("loss_mask", "uint8"),
                     FieldSpec("uid", "int64", (), per_token=False)), layout=LAYOUT, vocab_size=100)
    assert lead_field(schema) is None
    with StoreWriter(tmp_path, schema, flush_samples=4) as w:
        for u in range(8):
            w.add({"input_ids": torch.arange(u + 1, dtype=torch.int32), "loss_mask": torch.ones(u + 1, dtype=torch.uint8),
                   "uid": torch.tensor(u)}, step=0)
    (hlen,) = struct.unpack("<Q", (tmp_path / SHARDS_DIR / list_commits(tmp_path)[1].shard).read_bytes()[:8])
    assert (8 + hlen) % 4096
    orig, forged = forge(tmp_path, 1, FORGED, 0, relabel_header=True)
    code, errors = inspect_json(tmp_path, "--verify-checksums", capsys=capsys)
    assert code == 1 and [e["kind"] for e in errors] == ["duplicate_content"]
    assert f"same tensors as {SHARDS_DIR}/{orig.shard}" in errors[0]["message"]
    reader = StoreReader(tmp_path, shuffle=False, verify_checksums=True, prefetch=0)
    it = reader.iter_samples()
    assert [int(next(it)["uid"]) for _ in range(8)] == list(range(8))
    with pytest.raises(CorruptShardError, match=rf"{forged.shard}: same tensors as {orig.shard}"):
        next(it)
