"""Shard encoding (plain safetensors: 8-byte LE header size, JSON header, raw bytes) and zero-copy decoding.

A shard of ``n`` samples holds, per per-token field, one tensor ``[sum(T_i), *shape]`` (samples
concatenated along the token axis), per segment an ``offsets`` tensor int64 ``[n + 1]`` (sample i
is rows ``offsets[i]:offsets[i+1]``), per per-sample field ``[n, *shape]``, and the store's own
``global_step``/``policy_version`` int64 ``[n]``. Worked example: lengths (3, 1, 2) ->
``offsets = [0, 3, 4, 6]``, sample 1 = rows 3:4.

Tensors are laid out by decreasing item size then name (like ``safetensors.torch.save``), with the
header padded to 8 bytes, so every tensor is aligned and any safetensors reader opens the file.
The checksum (checksum.py, over the whole file) is computed in a thread while the bytes are written.
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import struct
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from feature_store.buffer import clone
from feature_store.checksum import SectorSumHasher
from feature_store.errors import CorruptShardError, SchemaDriftError
from feature_store.schema import DTYPES, STORE_SCALARS, Schema, offsets_name

ST_ITEMSIZE = {code: td.itemsize for td, code in DTYPES.values()}
ST_TORCH = {code: td for td, code in DTYPES.values()}
MAX_HEADER = 100 << 20
_PAGE = mmap.PAGESIZE


@dataclass(frozen=True)
class Entry:
    """A tensor to write: safetensors dtype code, full shape, and its bytes as consecutive chunks."""

    name: str
    st_dtype: str
    shape: tuple[int, ...]
    chunks: Sequence[Any]   # C-contiguous buffers (np.ndarray / bytes / memoryview), written in order


_SLICE = 8 << 20   # one syscall / one hasher update at most this big (a single 100 MB write racing a single
                   # 100 MB hash of the same pages ran up to 10x slower than both sliced)


def _slices(chunks: Sequence[memoryview]) -> Iterator[memoryview]:
    for c in chunks:
        for i in range(0, c.nbytes, _SLICE):
            yield c[i: i + _SLICE]


def _hash_all(chunks: Sequence[memoryview], out: list[str]) -> None:
    h = SectorSumHasher()
    for c in _slices(chunks):
        h.update(c)                # numpy releases the GIL: runs on another core while the bytes are written
    out.append(h.hexdigest())


def _load_sync_file_range() -> Callable[[int, int, int], None] | None:
    """Linux ``sync_file_range(fd, off, n, SYNC_FILE_RANGE_WRITE)``: start writeback of a range without waiting.
    None where unavailable (the final fsync alone then makes the file durable, as it always does)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    fn.restype = ctypes.c_int

    def start_writeback(fd: int, offset: int, nbytes: int) -> None:
        fn(fd, offset, nbytes, 2)      # SYNC_FILE_RANGE_WRITE; a failure only forgoes the head start
    return start_writeback


start_writeback = _load_sync_file_range()


def write_shard(path: Path, entries: Sequence[Entry], metadata: dict[str, str]) -> tuple[int, str]:
    """Create ``path`` exclusively, write the shard, fsync. Returns (bytes written, checksum.py checksum)."""
    ordered = sorted(entries, key=lambda e: (-ST_ITEMSIZE[e.st_dtype], e.name))
    header: dict[str, Any] = {"__metadata__": metadata}
    payloads: list[memoryview] = []
    pos = 0
    for e in ordered:
        mvs = [memoryview(c).cast("B") for c in e.chunks]
        nbytes = sum(mv.nbytes for mv in mvs)
        expect = ST_ITEMSIZE[e.st_dtype] * int(np.prod(e.shape, dtype=np.int64))
        if nbytes != expect:
            raise ValueError(f"shard entry {e.name!r}: {nbytes} bytes, expected {expect} for shape {e.shape}")
        header[e.name] = {"dtype": e.st_dtype, "shape": list(e.shape), "data_offsets": [pos, pos + nbytes]}
        payloads += mvs
        pos += nbytes
    hjson = json.dumps(header, separators=(",", ":")).encode()
    hjson += b" " * (-len(hjson) % 8)
    chunks = [memoryview(struct.pack("<Q", len(hjson)) + hjson), *payloads]
    digest: list[str] = []
    hasher = threading.Thread(target=_hash_all, args=(chunks, digest), daemon=True)
    hasher.start()
    total = 0
    try:
        with open(path, "xb", buffering=0) as f:
            for c in _slices(chunks):
                done = 0
                while done < c.nbytes:
                    done += f.write(c[done:]) or 0
                if start_writeback is not None:      # the device works while the next slices are copied
                    start_writeback(f.fileno(), total, done)
                total += done
            os.fsync(f.fileno())
    finally:
        hasher.join()
    return total, digest[0]


@dataclass(frozen=True)
class TensorInfo:
    st_dtype: str
    shape: tuple[int, ...]
    begin: int   # absolute file offset
    end: int


def read_header(path: Path, fd: int, size: int) -> tuple[dict[str, TensorInfo], dict[str, str]]:
    """Parse and check a safetensors header (bounds, dtypes, contiguous coverage of the data)."""
    def bad(why: str) -> CorruptShardError:
        return CorruptShardError(f"{path}: not a valid shard ({why})")
    if size < 8:
        raise bad(f"{size} bytes, shorter than the 8-byte header size")
    (hlen,) = struct.unpack("<Q", os.pread(fd, 8, 0))
    if hlen > min(MAX_HEADER, size - 8):
        raise bad(f"header size {hlen} exceeds the file ({size} bytes): foreign or truncated file")
    try:
        header = json.loads(os.pread(fd, hlen, 8))
        meta = dict(header.pop("__metadata__", {}) or {})
        infos = {name: TensorInfo(d["dtype"], tuple(int(x) for x in d["shape"]), 8 + hlen + d["data_offsets"][0],
                                  8 + hlen + d["data_offsets"][1]) for name, d in header.items()}
    except (ValueError, KeyError, TypeError, AttributeError, IndexError) as e:
        raise bad(f"header unparseable: {type(e).__name__}: {e}") from e
    pos = 8 + hlen
    for name, t in sorted(infos.items(), key=lambda kv: kv[1].begin):
        if t.st_dtype not in ST_ITEMSIZE:
            raise bad(f"tensor {name!r} dtype {t.st_dtype!r} unknown")
        want = ST_ITEMSIZE[t.st_dtype] * int(np.prod(t.shape, dtype=np.int64))
        if t.begin != pos or t.end - t.begin != want:
            raise bad(f"tensor {name!r} bytes [{t.begin}, {t.end}) do not follow at {pos} with {want} bytes")
        pos = t.end
    if pos != size:
        raise bad(f"data ends at byte {pos}, file has {size} bytes (truncated or padded)")
    return infos, meta


class ShardView:
    """A memory-mapped shard. ``sample(i)`` returns views of sample i's rows (no copy, no other bytes read).

    The mapping is private copy-on-write: a caller writing into a returned tensor changes only its own
    memory, never the file. ``MADV_RANDOM`` stops read-around; each sample's byte ranges get
    ``MADV_WILLNEED`` so a cold read fetches exactly those pages.
    """

    def __init__(self, path: Path, schema: Schema, *, expect_nbytes: int | None = None) -> None:
        self.path, self.schema = path, schema
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            if expect_nbytes is not None and size != expect_nbytes:
                raise CorruptShardError(f"{path}: {size} bytes on disk, commit record says {expect_nbytes} "
                                        "(truncated or replaced shard)")
            infos, meta = read_header(path, fd, size)
            self._check(infos, meta)
            self._mm = mmap.mmap(fd, size, access=mmap.ACCESS_COPY)
        finally:
            os.close(fd)
        if hasattr(mmap, "MADV_RANDOM"):
            self._mm.madvise(mmap.MADV_RANDOM)
        self._infos = infos
        self.offsets = {seg: self._array(infos[offsets_name(seg)]) for seg in schema.segments}
        self.scalars = {name: self._array(infos[name]) for name in STORE_SCALARS}
        self.num_samples = len(self.offsets["tokens"]) - 1
        self._views = {f.name: self._view(infos[f.name]) for f in schema.fields}
        self.validate_offsets()

    def _array(self, t: TensorInfo) -> np.ndarray:
        return np.frombuffer(self._mm, dtype=np.int64, count=t.shape[0], offset=t.begin).copy()

    def _view(self, t: TensorInfo) -> torch.Tensor:
        if t.end == t.begin:
            return torch.empty(t.shape, dtype=ST_TORCH[t.st_dtype])
        count = (t.end - t.begin) // ST_ITEMSIZE[t.st_dtype]
        return torch.frombuffer(self._mm, dtype=ST_TORCH[t.st_dtype], count=count, offset=t.begin).view(t.shape)

    def _check(self, infos: dict[str, TensorInfo], meta: dict[str, str]) -> None:
        p, schema = self.path, self.schema
        if meta.get("schema_hash") != schema.hash:
            raise SchemaDriftError(f"{p}: shard schema hash {meta.get('schema_hash')!r}, store schema hash "
                                   f"{schema.hash!r} (foreign shard or schema drift)")
        want = {f.name for f in schema.fields} | set(STORE_SCALARS) | {offsets_name(s) for s in schema.segments}
        if set(infos) != want:
            raise CorruptShardError(f"{p}: tensors missing {sorted(want - set(infos))}, "
                                    f"unexpected {sorted(set(infos) - want)}")
        off = infos["offsets"]
        if off.st_dtype != "I64" or len(off.shape) != 1 or off.shape[0] < 1:
            raise CorruptShardError(f"{p}: 'offsets' is {off.st_dtype}{list(off.shape)}, expected I64[n+1]")
        n = off.shape[0] - 1
        expect: dict[str, tuple[str, tuple[int, ...]]] = {s: ("I64", (n,)) for s in STORE_SCALARS}
        expect.update({offsets_name(seg): ("I64", (n + 1,)) for seg in schema.segments})
        for f in schema.fields:   # -1: the row count, checked against the offsets once mapped
            expect[f.name] = (f.st_dtype, ((-1,) if f.per_token else (n,)) + f.shape)
        for name, (dt, shape) in expect.items():
            t = infos[name]
            if t.st_dtype != dt or len(t.shape) != len(shape) or any(
                    e not in (-1, a) for e, a in zip(shape, t.shape)):
                raise CorruptShardError(f"{p}: tensor {name!r} is {t.st_dtype}{list(t.shape)}, expected "
                                        f"{dt}{['T' if e == -1 else e for e in shape]}")

    def validate_offsets(self) -> None:
        """Offsets start at 0, never decrease, and end at each per-token tensor's row count."""
        for seg, off in self.offsets.items():
            if off[0] != 0 or np.any(np.diff(off) < 0):
                raise CorruptShardError(f"{self.path}: offsets of segment {seg!r} must start at 0 and not "
                                        f"decrease, found {off[:8].tolist()}...")
            for f in self.schema.fields:
                if f.per_token and f.segment == seg and self._views[f.name].shape[0] != off[-1]:
                    raise CorruptShardError(f"{self.path}: field {f.name!r} has {self._views[f.name].shape[0]} "
                                            f"rows, offsets of segment {seg!r} end at {off[-1]}")

    @property
    def lengths(self) -> np.ndarray:
        """Tokens per sample ``[n]`` (segment ``tokens``)."""
        return np.diff(self.offsets["tokens"])

    def sample(self, i: int, copy: bool = False) -> dict[str, torch.Tensor]:
        if not 0 <= i < self.num_samples:
            raise IndexError(f"{self.path}: sample {i} out of range [0, {self.num_samples})")
        out: dict[str, torch.Tensor] = {}
        for f in self.schema.fields:
            view = self._views[f.name]
            if f.per_token:
                a, b = int(self.offsets[f.segment][i]), int(self.offsets[f.segment][i + 1])
                self._willneed(self._infos[f.name].begin, a * f.row_nbytes, b * f.row_nbytes)
                t = view[a:b]
            else:
                t = view[i]
            out[f.name] = clone(t) if copy else t
        for name, arr in self.scalars.items():
            out[name] = torch.tensor(int(arr[i]), dtype=torch.int64)
        return out

    def _willneed(self, base: int, a: int, b: int) -> None:
        if b - a >= _PAGE and hasattr(mmap, "MADV_WILLNEED"):
            start = (base + a) // _PAGE * _PAGE
            self._mm.madvise(mmap.MADV_WILLNEED, start, base + b - start)

    def close(self) -> None:
        self._views.clear()
        try:
            self._mm.close()
        except BufferError:   # tensors handed out still map it; the mapping goes when they do
            pass
