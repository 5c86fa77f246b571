"""Round trip on real files: random samples of varied lengths and every dtype come back bit-exact,
through our reader and through the reference ``safetensors`` library; reads are zero-copy views that
touch only the sample's pages; dtype casting and flush policies behave as documented."""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import assert_bit_equal, make_sample, make_schema, read_uids, write_store
from safetensors import safe_open

from feature_store import FieldSpec, Layout, Schema, StoreIndex, StoreReader, StoreWriter, standard_schema
from feature_store.store import SHARDS_DIR, list_commits


@pytest.mark.parametrize("copy_inputs", [True, False])
def test_round_trip_bit_exact(tmp_path: Path, copy_inputs: bool) -> None:
    uids = list(range(137))
    write_store(tmp_path, uids, flush_samples=11, copy_inputs=copy_inputs)
    reader = StoreReader(tmp_path, shuffle=False, prefetch=3, verify_checksums=True, check_values=True)
    it = reader.iter_samples()
    for u in uids:
        got = next(it)
        assert_bit_equal(got, make_sample(u))
        assert int(got["global_step"]) == u // 10 and int(got["policy_version"]) == u // 20
    reader.close()


def test_shards_are_plain_safetensors(tmp_path: Path) -> None:
    """The reference library reads every shard; concatenated fields + offsets give back each sample."""
    uids = list(range(30))
    write_store(tmp_path, uids, flush_samples=8)
    schema = make_schema()
    u = 0
    for rec in list_commits(tmp_path):
        with safe_open(str(tmp_path / SHARDS_DIR / rec.shard), "pt") as f:
            assert f.metadata()["schema_hash"] == schema.hash
            off, woff = f.get_tensor("offsets"), f.get_tensor("offsets.window")
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        assert rec.num_samples == len(off) - 1 and rec.num_tokens == int(off[-1])
        for i in range(rec.num_samples):
            expected = make_sample(u)
            for spec in schema.fields:
                t = tensors[spec.name]
                o = woff if spec.segment == "window" else off
                got = t[o[i]: o[i + 1]] if spec.per_token else t[i]
                assert_bit_equal({spec.name: got}, {spec.name: expected[spec.name]})
            assert int(tensors["global_step"][i]) == u // 10
            u += 1
    assert u == len(uids)


def test_standard_schema_casts_float32_to_bf16(tmp_path: Path) -> None:
    layout = Layout((1, 2))
    schema = standard_schema(layout, hidden_size=4, vocab_size=50, target_model_id="m")
    assert schema.field("aux_hidden").dtype == "bfloat16" and schema.field("aux_hidden").shape == (8,)
    hidden = torch.randn(5, 8)
    sample = {"input_ids": torch.arange(5), "loss_mask": torch.ones(5, dtype=torch.uint8),
              "aux_hidden": hidden, "last_hidden": torch.randn(5, 4)}
    with StoreWriter(tmp_path, schema) as w:
        w.add(sample, step=3)
    got = next(StoreReader(tmp_path, prefetch=0).iter_samples())
    assert got["aux_hidden"].dtype == torch.bfloat16
    assert torch.equal(got["aux_hidden"], hidden.to(torch.bfloat16))   # round-to-nearest, as .to() does
    assert int(got["policy_version"]) == -1
    half = standard_schema(layout, hidden_size=4, vocab_size=50, target_model_id="m", hidden_dtype="float16")
    assert half.field("last_hidden").dtype == "float16" and half.hash != schema.hash


@pytest.mark.parametrize("copy_inputs", [True, False])
def test_integer_casts_are_range_checked(tmp_path: Path, copy_inputs: bool) -> None:
    from feature_store import SampleError
    schema = make_schema()
    w = StoreWriter(tmp_path, schema, copy_inputs=copy_inputs)
    s = make_sample(1)
    s["input_ids"] = s["input_ids"].to(torch.int64)        # fits int32: accepted and cast
    s["flags"] = s["flags"].to(torch.uint8)                # 0/1 into bool: accepted
    w.add(s, step=0)
    bad = make_sample(2)
    bad["input_ids"] = bad["input_ids"].to(torch.int64) + (1 << 40)
    with pytest.raises(SampleError, match=r"field 'input_ids': values in \[\d+, \d+\] do not fit int32"):
        w.add(bad, step=0)
    bad = make_sample(3)
    bad["input_ids"] = bad["input_ids"].float()
    with pytest.raises(SampleError, match="field 'input_ids': dtype float32, expected int32"):
        w.add(bad, step=0)
    w.close()
    got = next(StoreReader(tmp_path, prefetch=0).iter_samples())
    assert_bit_equal(got, make_sample(1))


def _mmap_range(view: object) -> tuple[int, int]:
    mm = view._mm  # type: ignore[attr-defined]
    anchor = ctypes.c_char.from_buffer(mm)
    addr = ctypes.addressof(anchor)
    del anchor
    return addr, len(mm)


def test_samples_are_zero_copy_views(store: Path) -> None:
    index = StoreIndex.open(store)
    k, i = index.locate(20)
    view = index.shard(k)
    lo, size = _mmap_range(view)
    sample = index.sample(20)
    for name in ("aux_hidden", "input_ids", "win_hidden"):
        t = sample[name]
        if t.numel():
            assert lo <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size() <= lo + size, name
    copied = index.sample(20, copy=True)
    assert not (lo <= copied["aux_hidden"].data_ptr() < lo + size)
    sample["aux_hidden"].zero_()          # private copy-on-write mapping: the file is unchanged
    assert_bit_equal(StoreIndex.open(store).sample(20), make_sample(20))


def _resident_pages(path: Path) -> np.ndarray:
    """Page-cache residency of ``path``, one 0/1 per page (mincore on a fresh read-only mapping)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    size = path.stat().st_size
    with open(path, "rb") as f:
        mm = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ)
    arr = np.frombuffer(mm, dtype=np.uint8)
    vec = (ctypes.c_ubyte * ((size + mmap.PAGESIZE - 1) // mmap.PAGESIZE))()
    rc = libc.mincore(ctypes.c_void_p(arr.ctypes.data), ctypes.c_size_t(size), vec)
    del arr
    mm.close()
    if rc != 0:
        pytest.skip(f"mincore failed: errno {ctypes.get_errno()}")
    return np.frombuffer(bytes(vec), dtype=np.uint8) & 1


def test_reading_one_sample_touches_only_its_pages(tmp_path: Path) -> None:
    schema = Schema((FieldSpec("input_ids", "int64"), FieldSpec("hidden", "float32", (1024,))), Layout((1,)),
                    vocab_size=100)
    n, t = 48, 64                                  # 48 samples x 256 KiB of hidden states
    with StoreWriter(tmp_path, schema, flush_samples=n) as w:
        for u in range(n):
            w.add({"input_ids": torch.full((t,), u), "hidden": torch.full((t, 1024), float(u))}, step=0)
    shard = tmp_path / SHARDS_DIR / list_commits(tmp_path)[0].shard
    fd = os.open(shard, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    if _resident_pages(shard).mean() > 0.5:
        pytest.skip("the page cache keeps this file (tmpfs?): residency cannot be observed")
    index = StoreIndex.open(tmp_path)
    target = 30
    sample = index.sample(target)
    assert float(sample["hidden"].double().sum()) == 30.0 * t * 1024       # touches every byte of it
    resident = _resident_pages(shard)
    view = index.shard(0)
    begin, end = view._infos["hidden"].begin, view._infos["hidden"].end       # type: ignore[attr-defined]
    row = 1024 * 4
    lo, hi = begin + target * t * row, begin + (target + 1) * t * row
    page = mmap.PAGESIZE
    margin = 16 * page
    outside = [p for p in np.flatnonzero(resident) if p * page >= hi + margin or (p + 1) * page <= lo - margin]
    hidden_pages = [p for p in outside if begin <= p * page < end]
    assert all(resident[lo // page: (hi - 1) // page + 1]), "the sample's own pages were read"
    assert not hidden_pages, f"{len(hidden_pages)} pages of other samples' hidden states were read"


def test_copy_inputs_decides_who_owns_the_buffered_tensors(tmp_path: Path) -> None:
    for copy_inputs in (True, False):
        sample = make_sample(3)
        with StoreWriter(tmp_path / str(copy_inputs), make_schema(), copy_inputs=copy_inputs) as w:
            w.add(sample, step=0)
            for name in ("last_hidden", "aux_hidden"):    # the caller reuses its tensors before the flush
                sample[name].fill_(1.0)
        got = next(StoreReader(tmp_path / str(copy_inputs), prefetch=0).iter_samples())
        assert torch.equal(got["last_hidden"], sample["last_hidden"]) != copy_inputs   # copied / referenced
        # the largest per-token field goes to the shard file during add(), in both modes
        assert torch.equal(got["aux_hidden"], make_sample(3)["aux_hidden"])


def test_flush_policies(tmp_path: Path) -> None:
    schema = make_schema()
    samples = [make_sample(u) for u in range(12)]
    nbytes = np.cumsum([sum(t.numel() * t.element_size() for t in s.values()) for s in samples])
    limit = int(nbytes[4]) - 1                      # reached exactly when the 5th sample is added
    with StoreWriter(tmp_path / "bytes", schema, flush_samples=10_000, flush_bytes=limit,
                     flush_interval_steps=0) as w:
        out = [w.add(s, step=0) for s in samples[:5]]
        assert [r is not None for r in out] == [False] * 4 + [True] and w.buffered_samples == 0
    with StoreWriter(tmp_path / "steps", schema, flush_samples=10_000, flush_interval_steps=2) as w:
        for step in range(6):
            for u in range(step * 3, step * 3 + 3):
                w.add(make_sample(u), step=step)
            rec = w.end_step(step)
            assert (rec is not None) == (step % 2 == 1), step
            if rec is not None:
                assert (rec.num_samples, rec.min_step, rec.max_step, rec.completed_step) == (6, step - 1, step, step)
        assert w.last_completed_step == 5
    with StoreWriter(tmp_path / "count", schema, flush_samples=4, flush_interval_steps=0) as w:
        out = [w.add(make_sample(u), step=0) for u in range(10)]
        assert [i for i, r in enumerate(out) if r is not None] == [3, 7]
    assert [c.num_samples for c in list_commits(tmp_path / "count")] == [4, 4, 2]
    with StoreWriter(tmp_path / "bytes2", schema, flush_samples=10_000, flush_bytes=1,
                     flush_interval_steps=0) as w:
        assert all(w.add(make_sample(u), step=0) is not None for u in range(3))


def test_restarted_writer_continues_never_overwrites(tmp_path: Path) -> None:
    first = write_store(tmp_path, list(range(20)), flush_samples=5)
    names = {p.name: p.stat().st_mtime_ns for p in (tmp_path / SHARDS_DIR).iterdir()}
    with StoreWriter(tmp_path, make_schema(), rank=0, flush_samples=5) as w:
        assert w.run_id != first.run_id and w.writer_id.startswith("r00000-")
        assert [c.shard for c in w.previous_commits] == [c.shard for c in first.commits]
        for u in range(20, 30):
            w.add(make_sample(u), step=9)
    after = {p.name: p.stat().st_mtime_ns for p in (tmp_path / SHARDS_DIR).iterdir()}
    assert all(after[n] == t for n, t in names.items())       # nothing rewritten
    assert sorted(read_uids(tmp_path)) == list(range(30))
