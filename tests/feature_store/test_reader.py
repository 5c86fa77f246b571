"""Reader order: deterministic shuffles, disjoint per-rank partitions (world sizes 1, 2, 3, both remainder
policies), endless epochs, exact mid-epoch resume (with and without prefetch, across epochs, in token
batches, after new commits), and token-budget batching against a greedy grouping written out here."""

from __future__ import annotations

import json
from itertools import islice
from pathlib import Path

import numpy as np
import pytest
from conftest import make_sample, write_store

from feature_store import ResumeStateError, SampleError, StoreReader
from feature_store.order import permutation, rank_order
from feature_store.store import SHARDS_DIR, list_commits


def uids(reader: StoreReader, n: int) -> list[int]:
    return [int(s["uid"]) for s in islice(reader.iter_samples(), n)]


_M64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def _reference_permutation(n: int, seed: int, epoch: int) -> list[int]:
    """Pure-Python reference of order.permutation: sort indices by splitmix64(i ^ key(seed, epoch))."""
    key = _splitmix64(_splitmix64(seed) ^ epoch)
    keys = [_splitmix64(i ^ key) for i in range(n)]
    return sorted(range(n), key=lambda i: (keys[i], i))


def test_permutation_golden_and_independent_of_everything_but_seed_epoch() -> None:
    assert permutation(10, 0, 0).tolist() == [0, 9, 1, 6, 3, 5, 4, 2, 8, 7]       # frozen: stores outlive code
    for seed, epoch in ((0, 0), (1, 0), (0, 1), (123456789, 7), (2**63 + 5, 2)):
        assert permutation(300, seed, epoch).tolist() == _reference_permutation(300, seed, epoch)
    assert permutation(10, 0, 1).tolist() != permutation(10, 0, 0).tolist()
    assert permutation(10, 1, 0).tolist() != permutation(10, 0, 0).tolist()
    p = permutation(1000, 7, 3)
    assert sorted(p.tolist()) == list(range(1000))


def test_partition_worked_example() -> None:
    # shuffle=False makes the permutation the identity: the policies are visible directly
    drop = [rank_order(5, seed=0, epoch=0, rank=r, world_size=2, shuffle=False).tolist() for r in range(2)]
    wrap = [rank_order(5, seed=0, epoch=0, rank=r, world_size=2, shuffle=False, remainder="wrap").tolist()
            for r in range(2)]
    assert drop == [[0, 2], [1, 3]]
    assert wrap == [[0, 2, 4], [1, 3, 0]]


def test_same_seed_same_order_prefetch_irrelevant(store: Path) -> None:
    a = uids(StoreReader(store, seed=3, prefetch=0), 120)
    b = uids(StoreReader(store, seed=3, prefetch=4), 120)
    c = uids(StoreReader(store, seed=4, prefetch=0), 120)
    assert a == b and a != c
    assert sorted(a[:50]) == list(range(50)) and sorted(a[50:100]) == list(range(50))   # whole epochs
    assert a[:50] != a[50:100]                                                            # reshuffled
    expected0 = [int(x) for x in permutation(50, 3, 0)]   # storage order is uid order in this store
    assert a[:50] == expected0


@pytest.mark.parametrize("world_size", [1, 2, 3])
@pytest.mark.parametrize("remainder", ["drop", "wrap"])
def test_partitions_disjoint_and_covering(store: Path, world_size: int, remainder: str) -> None:
    for epoch in range(2):
        per_rank = []
        for rank in range(world_size):
            r = StoreReader(store, seed=11, rank=rank, world_size=world_size, remainder=remainder, prefetch=0)
            stream = uids(r, len(r) * (epoch + 1))
            per_rank.append(stream[len(r) * epoch:])
        counts = {len(p) for p in per_rank}
        assert len(counts) == 1                                          # equal counts per rank
        flat = [u for p in per_rank for u in p]
        perm = permutation(50, 11, epoch).tolist()
        if remainder == "drop":
            assert counts == {50 // world_size}
            assert len(set(flat)) == len(flat)                           # disjoint
            assert set(flat) == set(perm[: (50 // world_size) * world_size])
        else:
            assert counts == {-(-50 // world_size)}
            assert set(flat) == set(range(50))                           # every sample seen
            assert len(flat) - len(set(flat)) == (-50) % world_size      # only the padding repeats


@pytest.mark.parametrize("prefetch", [0, 3])
@pytest.mark.parametrize("cut", [1, 17, 25, 50, 73])
def test_exact_resume(store: Path, prefetch: int, cut: int) -> None:
    kw = dict(seed=5, rank=1, world_size=2, prefetch=prefetch)
    full = uids(StoreReader(store, **kw), 130)                           # uninterrupted
    first = StoreReader(store, **kw)
    assert uids(first, cut) == full[:cut]
    state = json.loads(json.dumps(first.state_dict()))                   # survives JSON
    first.close()
    resumed = StoreReader(store, **kw)
    resumed.load_state_dict(state)
    assert uids(resumed, 130 - cut) == full[cut:]


def test_resume_ignores_shards_committed_later(store: Path) -> None:
    full = uids(StoreReader(store, seed=2, prefetch=0), 80)
    r = StoreReader(store, seed=2, prefetch=0)
    uids(r, 30)
    state = r.state_dict()
    write_store(store, list(range(50, 70)), rank=1)                      # new commits arrive
    resumed = StoreReader(store, seed=2, prefetch=0)
    assert len(resumed) == 70
    resumed.load_state_dict(state)
    assert len(resumed) == 50 and uids(resumed, 50) == full[30:80]


def test_refresh_applies_at_next_epoch(store: Path) -> None:
    r = StoreReader(store, seed=2, prefetch=2)
    head = uids(r, 10)
    write_store(store, list(range(50, 70)), rank=1)
    assert r.refresh() is True and r.refresh() is True
    rest = uids(r, 40 + 70)
    epoch0, epoch1 = head + rest[:40], rest[40:]
    assert sorted(epoch0) == list(range(50)) and sorted(epoch1) == list(range(70))
    assert r.state_dict()["num_samples"] == 70 and r.epoch == 1 and r.position == 70


def test_resume_state_mismatches_are_errors(store: Path) -> None:
    r = StoreReader(store, seed=2, prefetch=0)
    uids(r, 5)
    state = r.state_dict()
    with pytest.raises(ResumeStateError, match=r"world_size=1, this reader has world_size=2"):
        StoreReader(store, seed=2, world_size=2, prefetch=0).load_state_dict(state)
    with pytest.raises(ResumeStateError, match=r"seed=2, this reader has seed=9"):
        StoreReader(store, seed=9, prefetch=0).load_state_dict(state)
    with pytest.raises(ResumeStateError, match=r"missing keys \['fingerprint'\]"):
        StoreReader(store, seed=2, prefetch=0).load_state_dict({k: v for k, v in state.items() if k != "fingerprint"})
    victim = list_commits(store)[3]
    (store / SHARDS_DIR / victim.name).with_suffix(".commit.json").unlink()     # a shard was removed
    with pytest.raises(ResumeStateError, match="committed shards changed"):
        StoreReader(store, seed=2, prefetch=0).load_state_dict(state)


def _greedy(lengths: list[int], budget: int) -> list[list[int]]:
    batches, cur, used = [], [], 0
    for i, n in enumerate(lengths):
        if cur and used + n > budget:
            batches.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += n
        if n > budget:                           # an oversize sample goes alone
            batches.append(cur)
            cur, used = [], 0
    return batches + ([cur] if cur else [])


def test_token_budget_batches_match_greedy_grouping_and_resume(store: Path) -> None:
    budget = 60                                  # samples have 1..40 tokens
    stream = [int(s["uid"]) for s in islice(StoreReader(store, seed=1, prefetch=0).iter_samples(), 150)]
    lengths = [int(make_sample(u)["input_ids"].shape[0]) for u in stream]
    expected = [[stream[i] for i in b] for b in _greedy(lengths, budget)][:-1]   # last one may be cut
    reader = StoreReader(store, seed=1, prefetch=2)
    batches = reader.iter_batches(budget)
    got = [[int(s["uid"]) for s in next(batches)] for _ in range(len(expected))]
    assert got == expected
    assert all(sum(int(s["input_ids"].shape[0]) for s in b) <= budget for b in (next(batches) for _ in range(3)))
    # resume after 5 batches gives the same following batches
    r1 = StoreReader(store, seed=1, prefetch=0)
    b1 = r1.iter_batches(budget)
    for _ in range(5):
        next(b1)
    r2 = StoreReader(store, seed=1, prefetch=0)
    r2.load_state_dict(r1.state_dict())
    b2 = r2.iter_batches(budget)
    for _ in range(5):
        assert [int(s["uid"]) for s in next(b1)] == [int(s["uid"]) for s in next(b2)]


def test_oversize_samples_alone_or_error(store: Path) -> None:
    stream = [int(s["uid"]) for s in islice(StoreReader(store, seed=1, prefetch=0).iter_samples(), 50)]
    lengths = [int(make_sample(u)["input_ids"].shape[0]) for u in stream]
    budget = 20
    alone = StoreReader(store, seed=1, prefetch=0).iter_batches(budget, oversize="alone")
    expected = _greedy(lengths, budget)
    for b in expected[:-1]:
        assert [int(s["uid"]) for s in next(alone)] == [stream[i] for i in b]
    first_big = next(i for i, n in enumerate(lengths) if n > budget)
    err = StoreReader(store, seed=1, prefetch=0)
    it = err.iter_batches(budget, oversize="error")
    with pytest.raises(SampleError, match=rf"{lengths[first_big]} tokens, over token_budget=20"):
        for _ in range(len(expected)):
            next(it)
    assert err.position == first_big                         # the oversize sample was not consumed
    b = next(StoreReader(store, seed=1, prefetch=0).iter_batches(10**6, max_samples=7))
    assert [int(s["uid"]) for s in b] == stream[:7]


def test_epoch_order_is_a_numpy_slice_of_the_permutation(store: Path) -> None:
    r = StoreReader(store, seed=4, rank=2, world_size=3, prefetch=0)
    order = r.epoch_order(6)
    assert isinstance(order, np.ndarray)
    assert order.tolist() == permutation(50, 4, 6)[: 16 * 3][2::3].tolist()
