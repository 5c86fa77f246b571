"""Deterministic sample order: a global permutation from (seed, epoch) and disjoint per-rank partitions.

The permutation sorts a counter-based hash (splitmix64) of each index, so it depends only on
(seed, epoch, n): identical on every rank, machine and numpy/torch version.

Partition (world size W, rank r) of the epoch's permutation ``perm`` (length n):
- ``remainder="drop"`` (default): each rank gets ``n // W`` samples, ``perm[:W*(n//W)][r::W]``;
  the ``n % W`` samples at the end of the permutation are skipped this epoch (another set next epoch).
- ``remainder="wrap"``: each rank gets ``ceil(n / W)`` samples; the permutation is extended by
  wrapping around to its start, so every sample is seen and ``(-n) % W`` samples are seen twice."""

from __future__ import annotations

import numpy as np

REMAINDER_POLICIES = ("drop", "wrap")
_M64 = (1 << 64) - 1


def _splitmix64(x: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = x + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def _mix(seed: int, epoch: int) -> np.uint64:
    k = _splitmix64(np.array([seed & _M64], dtype=np.uint64))
    k = _splitmix64(k ^ np.uint64(epoch & _M64))
    return np.uint64(k[0])


def permutation(n: int, seed: int, epoch: int) -> np.ndarray:
    """A permutation of ``range(n)`` (int64) determined by (seed, epoch) only."""
    keys = _splitmix64(np.arange(n, dtype=np.uint64) ^ _mix(seed, epoch))
    return np.argsort(keys, kind="stable").astype(np.int64)


def per_rank_count(n: int, world_size: int, remainder: str) -> int:
    if remainder not in REMAINDER_POLICIES:
        raise ValueError(f"remainder={remainder!r}: expected one of {REMAINDER_POLICIES}")
    return n // world_size if remainder == "drop" else -(-n // world_size)


def rank_order(n: int, *, seed: int, epoch: int, rank: int, world_size: int, shuffle: bool = True,
               remainder: str = "drop") -> np.ndarray:
    """Global sample indices rank ``rank`` reads in epoch ``epoch`` (int64, length per_rank_count)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank}: expected 0 <= rank < world_size={world_size}")
    per = per_rank_count(n, world_size, remainder)
    perm = permutation(n, seed, epoch) if shuffle else np.arange(n, dtype=np.int64)
    if n == 0:
        return perm
    perm = np.resize(perm, per * world_size)   # drop: truncates; wrap: repeats from the start
    return perm[rank::world_size]
