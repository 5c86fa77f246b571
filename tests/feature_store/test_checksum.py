"""The shard checksum against a straightforward pure-Python rendering of its definition (checksum.py),
for every chunking; and the corruptions it must catch."""

from __future__ import annotations

import hashlib
import os
import random
import struct
from pathlib import Path

import pytest

from feature_store.checksum import SectorSumHasher, file_checksum, file_checksums


def reference(data: bytes) -> str:
    """Sectors of 4096 bytes (last zero-padded), wrapping uint64 word sums, sha256 with the length."""
    padded = data + b"\0" * (-len(data) % 4096)
    sums = b""
    for s in range(0, len(padded), 4096):
        words = struct.unpack("<512Q", padded[s: s + 4096])
        sums += struct.pack("<Q", sum(words) % 2**64)
    return "s64x4k:" + hashlib.sha256(sums + struct.pack("<Q", len(data))).hexdigest()[:32]


def digest(data: bytes, cuts: list[int]) -> str:
    h = SectorSumHasher()
    prev = 0
    for c in sorted(cuts) + [len(data)]:
        h.update(data[prev:c])
        prev = c
    return h.hexdigest()


@pytest.mark.parametrize("size", [0, 1, 7, 4096, 4097, (1 << 20) - 3, (1 << 20) * 3 + 4095])
def test_matches_reference_for_any_chunking(size: int, tmp_path: Path) -> None:
    rng = random.Random(size)
    data = os.urandom(size)
    expected = reference(data)
    for _ in range(4):
        cuts = [rng.randrange(size + 1) for _ in range(rng.randrange(0, 6))]
        assert digest(data, cuts) == expected
    (tmp_path / "f").write_bytes(data)
    assert file_checksum(tmp_path / "f", chunk=4096 * 3 + 5) == expected


def test_detects_flips_truncation_and_swapped_sectors() -> None:
    data = bytearray(os.urandom(64 * 4096 + 100))
    base = digest(bytes(data), [])
    rng = random.Random(0)
    for _ in range(200):                          # any single flipped bit anywhere
        i, bit = rng.randrange(len(data)), 1 << rng.randrange(8)
        data[i] ^= bit
        assert digest(bytes(data), []) != base
        data[i] ^= bit
    assert digest(bytes(data[:-1]), []) != base
    assert digest(bytes(data) + b"\0", []) != base                              # even a zero byte appended
    swapped = data[4096:8192] + data[:4096] + data[8192:]
    assert digest(bytes(swapped), []) != base
    zeroed = bytes(4096) + data[4096:]
    assert digest(bytes(zeroed), []) != base


@pytest.mark.parametrize("size", [0, 100, 4096, 3 * 4096 + 17, (1 << 20) + 5])
def test_checksum_of_the_tail_in_the_same_read(size: int, tmp_path: Path) -> None:
    """``file_checksums(path, start)`` = (checksum of the file, checksum of its bytes from ``start`` on),
    whether ``start`` falls on a sector boundary or not, past the end included (an empty tail)."""
    data = os.urandom(size)
    (tmp_path / "f").write_bytes(data)
    for start in sorted({0, 1, 8, 4095, 4096, 8192, size // 2, size, size + 10}):
        assert file_checksums(tmp_path / "f", start, chunk=4096 * 3 + 5) == (reference(data), reference(data[start:]))
