"""The shard checksum ``s64x4k``: cheap enough to compute while writing (numpy word sums, several times
faster than zlib.crc32).

Definition (independent of how the bytes are chunked): split the file into 4096-byte sectors from offset 0,
zero-padding the last one; each sector's sum is the wrapping (mod 2**64) sum of its 512 little-endian
uint64 words; the checksum is ``"s64x4k:"`` + the first 32 hex digits of
``sha256(sector sums as little-endian uint64 || file length as little-endian uint64)``.

What it detects: any change confined to one 8-byte word (a flipped bit or byte anywhere), truncation or
extension (the length), lost, zeroed, swapped or misdirected sectors (sums are hashed in order), and random
corruption except with probability ~2**-64 per sector. What it does not: words permuted inside one sector."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import numpy as np

PREFIX = "s64x4k:"
SECTOR = 4096
_WORDS = SECTOR // 8
_BLOCK = 256 * SECTOR          # processed at once: 1 MiB (fits the cache)


class SectorSumHasher:
    """Streaming ``s64x4k``: ``update(buffer)`` any number of times, then ``hexdigest()``."""

    def __init__(self) -> None:
        self._scratch = np.zeros(_BLOCK // 8, dtype="<u8")
        self._scratch_bytes = self._scratch.view(np.uint8)
        self._fill = 0
        self._length = 0
        self._sums: list[bytes] = []

    def _sum(self, words: Any, nsectors: int) -> None:
        self._sums.append(words.reshape(nsectors, _WORDS).sum(axis=1, dtype="<u8").tobytes())

    def update(self, data: Any) -> None:
        src = np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)
        self._length += src.size
        pos = 0
        if self._fill:                                   # complete the pending block first
            take = min(_BLOCK - self._fill, src.size)
            self._scratch_bytes[self._fill: self._fill + take] = src[:take]
            self._fill += take
            pos = take
            if self._fill < _BLOCK:
                return
            self._sum(self._scratch, _BLOCK // SECTOR)
            self._fill = 0
        whole = (src.size - pos) // _BLOCK * _BLOCK      # block-aligned in the stream: hash in place
        if whole:
            self._sum(src[pos: pos + whole].view("<u8"), whole // SECTOR)
            pos += whole
        rest = src.size - pos
        self._scratch_bytes[:rest] = src[pos:]
        self._fill = rest

    @property
    def length(self) -> int:
        return self._length

    def copy(self) -> SectorSumHasher:
        """An independent hasher in the same state (to extend tentatively)."""
        other = SectorSumHasher()
        other._scratch_bytes[: self._fill] = self._scratch_bytes[: self._fill]
        other._fill, other._length, other._sums = self._fill, self._length, list(self._sums)
        return other

    def sector_sums(self) -> bytes:
        """The little-endian uint64 sums of every sector so far (the last one zero-padded); ends the stream."""
        if self._fill:
            nsec = -(-self._fill // SECTOR)
            self._scratch_bytes[self._fill: nsec * SECTOR] = 0
            self._sum(self._scratch[: nsec * _WORDS], nsec)
            self._fill = 0
        return b"".join(self._sums)

    def hexdigest(self) -> str:
        return combine([self.sector_sums()], self._length)


def combine(sector_sums: list[bytes], length: int) -> str:
    """``s64x4k`` from the sector sums of consecutive parts of a file, in file order (every part but the last
    a whole number of sectors: e.g. a header region hashed apart from the data after it), and its length."""
    digest = hashlib.sha256(b"".join(sector_sums) + length.to_bytes(8, "little")).hexdigest()
    return PREFIX + digest[:32]


def file_checksum(path: Path, chunk: int = 8 << 20) -> str:
    """``s64x4k`` of a whole file, streamed."""
    h = SectorSumHasher()
    buf = bytearray(chunk)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(memoryview(buf)[:n])
    return h.hexdigest()


def file_checksums(path: Path, start: int, chunk: int = 8 << 20) -> tuple[str, str]:
    """(``s64x4k`` of the whole file, ``s64x4k`` of its bytes from offset ``start`` on), in one read. A
    ``start`` past the end gives the checksum of no bytes. When ``start`` is a multiple of the sector, the
    tail's sector sums are the file's from there (one hasher); otherwise a second hasher takes the tail."""
    if start < 0:
        raise ValueError(f"start={start}: expected an offset >= 0")
    h = SectorSumHasher()
    tail = None if start % SECTOR == 0 else SectorSumHasher()
    buf = bytearray(chunk)
    pos = 0
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(memoryview(buf)[:n])
            if tail is not None and pos + n > start:
                tail.update(memoryview(buf)[max(0, start - pos): n])
            pos += n
    if tail is not None:
        return h.hexdigest(), tail.hexdigest()
    sums = h.sector_sums()
    return combine([sums], pos), combine([sums[start // SECTOR * 8:]], max(0, pos - start))
