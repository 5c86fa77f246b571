"""Shard encoding (plain safetensors: 8-byte LE header size, JSON header, raw bytes) and zero-copy decoding.

A shard of ``n`` samples holds, per per-token field, one tensor ``[sum(T_i), *shape]`` (samples
concatenated along the token axis), per segment an ``offsets`` tensor int64 ``[n + 1]`` (sample i
is rows ``offsets[i]:offsets[i+1]``), per per-sample field ``[n, *shape]``, and the store's own
``global_step``/``policy_version`` int64 ``[n]``. Worked example: lengths (3, 1, 2) ->
``offsets = [0, 3, 4, 6]``, sample 1 = rows 3:4.

``StoreWriter`` (``ShardStream``) pads the header to 4096 bytes and streams its largest per-token
field at ``add()`` time; ``write_shard`` writes everything at once. Either way every tensor is aligned,
any safetensors reader opens the file, and the checksum (checksum.py) is computed as bytes are written."""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import struct
import sys
import threading
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from feature_store.buffer import clone
from feature_store.checksum import SECTOR, SectorSumHasher, combine, file_checksums
from feature_store.encoding import decode_fp8, scale_problem
from feature_store.errors import CorruptShardError, SchemaDriftError
from feature_store.schema import DTYPES, STORE_SCALARS, FieldSpec, Schema, offsets_name, scale_name

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


def _header(ordered: Sequence[tuple[str, str, tuple[int, ...], int]], metadata: dict[str, str]) -> bytes:
    """The JSON header for tensors ``(name, dtype code, shape, nbytes)`` laid out in this order."""
    header: dict[str, Any] = {"__metadata__": metadata}
    pos = 0
    for name, st_dtype, shape, nbytes in ordered:
        header[name] = {"dtype": st_dtype, "shape": list(shape), "data_offsets": [pos, pos + nbytes]}
        pos += nbytes
    return json.dumps(header, separators=(",", ":")).encode()


def _checked(entries: Sequence[Entry]) -> list[tuple[Entry, list[memoryview], int]]:
    out = []
    for e in entries:
        mvs = [memoryview(c).cast("B") for c in e.chunks]
        nbytes = sum(mv.nbytes for mv in mvs)
        expect = ST_ITEMSIZE[e.st_dtype] * int(np.prod(e.shape, dtype=np.int64))
        if nbytes != expect:
            raise ValueError(f"shard entry {e.name!r}: {nbytes} bytes, expected {expect} for shape {e.shape}")
        out.append((e, mvs, nbytes))
    return out


def _order(entries: Sequence[Entry]) -> list[Entry]:
    return sorted(entries, key=lambda e: (-ST_ITEMSIZE[e.st_dtype], e.name))


def write_shard(path: Path, entries: Sequence[Entry], metadata: dict[str, str]) -> tuple[int, str]:
    """Create ``path`` exclusively, write the shard, fsync. Returns (bytes written, checksum.py checksum)."""
    checked = _checked(_order(entries))
    hjson = _header([(e.name, e.st_dtype, e.shape, n) for e, _, n in checked], metadata)
    hjson += b" " * (-len(hjson) % 8)
    chunks = [memoryview(struct.pack("<Q", len(hjson)) + hjson), *(mv for _, mvs, _ in checked for mv in mvs)]
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


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    done = 0
    while done < data.nbytes:
        done += os.pwrite(fd, data[done:], offset + done)


def _discard(fd: list[int], path: Path) -> None:
    if fd:
        os.close(fd.pop())
    path.unlink(missing_ok=True)


class ShardStream:
    """A shard file written while samples arrive, for the writer's largest per-token field (the *lead*).

    Layout: a header region of ``reserve`` bytes (a multiple of the 4096-byte checksum sector, the JSON
    padded with spaces, as safetensors allows), then the lead tensor's rows, appended by ``append`` at
    ``add()`` time straight from the caller's tensor (the one copy: into the page cache, writeback started
    at once), then at ``finish`` the other tensors (largest item size first, then name) and the header.
    The lead's row size is a multiple of 8, so every tensor stays aligned. The checksum is computed as the
    bytes go out: data sectors while appended, the header region apart (``checksum.combine``).
    ``reserve`` must hold the final header: ``header_reserve`` bounds it from the tensor names and ranks."""

    def __init__(self, path: Path, reserve: int) -> None:
        if reserve % SECTOR or reserve < SECTOR:
            raise ValueError(f"header reserve {reserve}: expected a positive multiple of {SECTOR}")
        self.path, self.reserve, self.end = path, reserve, reserve
        self._fd = [os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)]
        self._finalizer = weakref.finalize(self, _discard, self._fd, path)   # an abandoned writer leaves no file
        self._hasher: SectorSumHasher | None = SectorSumHasher()
        self.result: tuple[int, str] | None = None     # (bytes, checksum) once finished
        self.published = False

    @property
    def fd(self) -> int:
        return self._fd[0]

    @property
    def lead_nbytes(self) -> int:
        return self.end - self.reserve

    def append(self, data: Any) -> None:
        """Append lead rows. On an error the file is cut back (the hash is then recomputed at ``finish``)."""
        mv = memoryview(data).cast("B")
        try:
            for i in range(0, mv.nbytes, _SLICE):
                part = mv[i: i + _SLICE]
                _pwrite_all(self.fd, part, self.end + i)
                if start_writeback is not None:
                    start_writeback(self.fd, self.end + i, part.nbytes)
        except BaseException:
            self._hasher = None
            os.ftruncate(self.fd, self.end)
            raise
        if self._hasher is not None:
            self._hasher.update(mv)
        self.end += mv.nbytes

    def _rehash(self) -> SectorSumHasher:
        h = SectorSumHasher()
        with open(self.path, "rb", buffering=0) as f:
            f.seek(self.reserve)
            left = self.lead_nbytes
            while left > 0:
                chunk = f.read(min(left, _SLICE))
                if not chunk:
                    raise OSError(f"{self.path}: shorter than the {self.end} bytes written")
                h.update(chunk)
                left -= len(chunk)
        self._hasher = h
        return h

    def finish(self, lead: Entry, rest: Sequence[Entry], metadata: dict[str, str]) -> tuple[int, str]:
        """Write the other tensors and the header after the lead rows, fsync. Returns (bytes, checksum).
        May be called again after a failure (it starts over from the lead rows)."""
        checked = _checked(_order(rest))
        if ST_ITEMSIZE[lead.st_dtype] * int(np.prod(lead.shape, dtype=np.int64)) != self.lead_nbytes:
            raise ValueError(f"lead entry {lead.name!r}: shape {lead.shape} does not match the "
                             f"{self.lead_nbytes} bytes streamed")
        hjson = _header([(lead.name, lead.st_dtype, lead.shape, self.lead_nbytes)]
                        + [(e.name, e.st_dtype, e.shape, n) for e, _, n in checked], metadata)
        if 8 + len(hjson) > self.reserve:
            raise ValueError(f"{self.path}: header of {len(hjson)} bytes exceeds the {self.reserve} reserved")
        head = struct.pack("<Q", self.reserve - 8) + hjson + b" " * (self.reserve - 8 - len(hjson))
        os.ftruncate(self.fd, self.end)                   # drop what a failed earlier finish appended
        data_hash = (self._hasher or self._rehash()).copy()
        pos = self.end
        for c in _slices([mv for _, mvs, _ in checked for mv in mvs]):
            _pwrite_all(self.fd, c, pos)
            data_hash.update(c)
            if start_writeback is not None:
                start_writeback(self.fd, pos, c.nbytes)
            pos += c.nbytes
        _pwrite_all(self.fd, memoryview(head), 0)
        head_hash = SectorSumHasher()
        head_hash.update(head)
        os.fsync(self.fd)
        self.result = (pos, combine([head_hash.sector_sums(), data_hash.sector_sums()], pos))
        return self.result

    def close(self) -> None:
        """Close the file descriptor (the file stays)."""
        if self._fd:
            os.close(self._fd.pop())

    def discard(self) -> None:
        """Close and remove the temp file."""
        self._finalizer()


def header_reserve(tensors: Sequence[tuple[str, str, int]], metadata: dict[str, str]) -> int:
    """Bytes to reserve for a shard header over tensors ``(name, dtype code, rank)`` whatever their sizes:
    the header with every number at its widest, rounded up to whole checksum sectors."""
    wide = 10 ** 19
    hjson = _header([(n, dt, (wide,) * rank, wide) for n, dt, rank in tensors], metadata)
    return -(-(8 + len(hjson)) // SECTOR) * SECTOR


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
    if hasattr(os, "posix_fadvise"):      # no read-around: the header is followed by sample data
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
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


def read_shard_meta(path: Path) -> dict[str, str]:
    """The header metadata (``__metadata__``) of the shard at ``path``, its header checked by ``read_header``."""
    fd = os.open(path, os.O_RDONLY)
    try:
        return read_header(path, fd, os.fstat(fd).st_size)[1]
    finally:
        os.close(fd)


def shard_checksums(path: Path) -> tuple[str, str]:
    """(checksum of the file, checksum of its tensor bytes: those after the header), in one read. A file
    whose header size does not fit counts as all header (``read_header`` rejects it anyway)."""
    with open(path, "rb", buffering=0) as f:
        head = f.read(8)
    start = 8 + struct.unpack("<Q", head)[0] if len(head) == 8 else 0
    return file_checksums(path, start)


class ShardView:
    """A memory-mapped shard. ``sample(i)`` returns views of sample i's rows (no copy, no other bytes read).

    The mapping is private copy-on-write: a caller writing into a returned tensor changes only its own
    memory, never the file. ``MADV_RANDOM`` stops read-around; each sample's byte ranges get
    ``MADV_WILLNEED`` so a cold read fetches exactly those pages."""

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
            self.meta = meta        # the writer's header metadata: format, schema_hash, writer_id, seq
            self._mm = mmap.mmap(fd, size, access=mmap.ACCESS_COPY)
        finally:
            os.close(fd)
        if hasattr(mmap, "MADV_RANDOM"):
            self._mm.madvise(mmap.MADV_RANDOM)
        self._infos = infos
        self.offsets = {seg: self._array(infos[offsets_name(seg)]) for seg in schema.segments}
        self.scalars = {name: self._array(infos[name]) for name in STORE_SCALARS}
        self.num_samples = len(self.offsets["tokens"]) - 1
        self._views = {f.name: self._view(infos[f.name]) for f in schema.stored_fields}
        self._stored = {f.name: f for f in schema.stored_fields}   # the schema's cached specs, by tensor name
        self.validate_offsets()

    @property
    def infos(self) -> dict[str, TensorInfo]:
        """Every tensor's dtype, shape and absolute byte range in the file."""
        return dict(self._infos)

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
        want = {f.name for f in schema.stored_fields} | set(STORE_SCALARS) | {offsets_name(s) for s in schema.segments}
        if set(infos) != want:
            raise CorruptShardError(f"{p}: tensors missing {sorted(want - set(infos))}, "
                                    f"unexpected {sorted(set(infos) - want)}")
        off = infos["offsets"]
        if off.st_dtype != "I64" or len(off.shape) != 1 or off.shape[0] < 1:
            raise CorruptShardError(f"{p}: 'offsets' is {off.st_dtype}{list(off.shape)}, expected I64[n+1]")
        n = off.shape[0] - 1
        expect: dict[str, tuple[str, tuple[int, ...]]] = {s: ("I64", (n,)) for s in STORE_SCALARS}
        expect.update({offsets_name(seg): ("I64", (n + 1,)) for seg in schema.segments})
        for f in schema.stored_fields:   # -1: the row count, checked against the offsets once mapped
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
            for f in self.schema.stored_fields:
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
            if f.encoding != "raw":
                out[f.name] = self._decoded(f, i)
                continue
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

    def _decoded(self, f: FieldSpec, i: int) -> torch.Tensor:
        """Sample i's rows of the fp8-encoded field ``f``, decoded to ``f.dtype`` (a new tensor: the e4m3
        values and scales are read in place from the mapping); a scale that is not finite and > 0 is refused."""
        q_spec, s_spec = self._stored[f.name], self._stored[scale_name(f.name)]
        a, b = int(self.offsets[f.segment][i]), int(self.offsets[f.segment][i + 1])
        for spec in (q_spec, s_spec):
            self._willneed(self._infos[spec.name].begin, a * spec.row_nbytes, b * spec.row_nbytes)
        scale = self._views[s_spec.name][a:b]                                   # [T] float32
        problem = scale_problem(scale)
        if problem is not None:
            raise CorruptShardError(f"{self.path}: field {f.name!r} of sample {i}: {problem} (corrupted shard)")
        return decode_fp8(self._views[q_spec.name][a:b], scale, f.torch_dtype)

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
