"""``StoreIndex``: a snapshot of the committed shards and the global sample index over them.

Global order: commit records sorted by shard name, samples in shard order; global index g ->
(shard k, local i) by binary search over cumulative counts. Every commit is checked when the index
is built (schema hash, presence, byte size, header writer id and seq; provenance.py), and with
``verify_checksums`` each shard's checksum and tensor identity when first opened (a duplicate is
refused, never silently skipped). ``shard_set`` = {writer id: number of its shards} describes a
snapshot in reader states: writers commit in sequence order, so it selects the same shards later."""

from __future__ import annotations

import hashlib
import os
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import torch

from feature_store.errors import ChecksumError, CorruptShardError, SchemaDriftError
from feature_store.provenance import content_key, header_mismatch
from feature_store.schema import Schema
from feature_store.shard import ShardView, read_shard_meta, shard_checksums
from feature_store.store import SHARDS_DIR, CommitRecord, StoreMeta, list_commits, load_store


def select(commits: Sequence[CommitRecord], shard_set: Mapping[str, int]) -> list[CommitRecord]:
    return [c for c in commits if c.seq < shard_set.get(c.writer_id, 0)]


class StoreIndex:
    def __init__(self, root: str | os.PathLike[str], meta: StoreMeta, commits: Sequence[CommitRecord], *,
                 verify_checksums: bool = False, max_open_shards: int = 64) -> None:
        self.root, self.meta = Path(root), meta
        self.schema: Schema = meta.schema
        self.commits = sorted(commits, key=lambda c: c.shard)
        self.verify_checksums = verify_checksums
        self._dir = self.root / SHARDS_DIR
        for c in self.commits:
            self._check_commit(c)
        counts = [c.num_samples for c in self.commits]
        self._starts = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)]).astype(np.int64)
        self._open: OrderedDict[int, ShardView] = OrderedDict()
        self._verified: set[int] = set()
        self._contents: dict[str, int] = {}      # content key of each verified shard -> its position
        self._lock = threading.Lock()
        self._max_open = max_open_shards

    @classmethod
    def open(cls, root: str | os.PathLike[str], *, shard_set: Mapping[str, int] | None = None,
             verify_checksums: bool = False, max_open_shards: int = 64) -> StoreIndex:
        meta = load_store(root)
        commits = list_commits(root)
        if shard_set is not None:
            commits = select(commits, shard_set)
        return cls(root, meta, commits, verify_checksums=verify_checksums, max_open_shards=max_open_shards)

    def _check_commit(self, c: CommitRecord) -> None:
        where = self._dir / c.shard
        if c.schema_hash != self.meta.schema_hash:
            raise SchemaDriftError(f"{where}: committed with schema hash {c.schema_hash}, store.json has "
                                   f"{self.meta.schema_hash} (a writer with another schema)")
        try:
            size = os.stat(where).st_size
        except FileNotFoundError:
            raise CorruptShardError(f"{where}: commit record present but the shard file is missing") from None
        if size != c.nbytes:
            raise CorruptShardError(f"{where}: {size} bytes on disk, commit record says {c.nbytes} "
                                    "(truncated or replaced shard)")
        self._check_header(c, read_shard_meta(where))

    def _check_header(self, c: CommitRecord, meta: Mapping[str, str]) -> None:
        mismatch = header_mismatch(c, meta)
        if mismatch is not None:
            raise CorruptShardError(f"{self._dir / c.shard}: {mismatch}")

    # -- snapshot description -----------------------------------------------------------------------------
    @property
    def num_samples(self) -> int:
        return int(self._starts[-1])

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.commits)

    @property
    def num_bytes(self) -> int:
        return sum(c.nbytes for c in self.commits)

    @property
    def shard_set(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for c in self.commits:
            out[c.writer_id] = max(out.get(c.writer_id, 0), c.seq + 1)
        return out

    @property
    def fingerprint(self) -> str:
        text = "\n".join(f"{c.shard} {c.nbytes} {c.checksum}" for c in self.commits)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    # -- access ---------------------------------------------------------------------------------------------
    def locate(self, g: int) -> tuple[int, int]:
        """Global sample index -> (shard position, index inside the shard)."""
        if not 0 <= g < self.num_samples:
            raise IndexError(f"sample {g} out of range [0, {self.num_samples})")
        k = int(np.searchsorted(self._starts, g, side="right")) - 1
        return k, g - int(self._starts[k])

    def shard(self, k: int) -> ShardView:
        """The opened shard ``k`` (LRU cache of ``max_open_shards``; thread-safe)."""
        with self._lock:
            view = self._open.get(k)
            if view is not None:
                self._open.move_to_end(k)
                return view
        c = self.commits[k]
        path = self._dir / c.shard
        verify = self.verify_checksums and k not in self._verified
        if verify:
            found, tensor_sum = shard_checksums(path)
            if found != c.checksum:
                raise ChecksumError(f"{path}: checksum {found}, commit record says {c.checksum} "
                                    "(the shard's bytes changed after commit)")
        view = ShardView(path, self.schema, expect_nbytes=c.nbytes)
        self._check_header(c, view.meta)
        if view.num_samples != c.num_samples:
            raise CorruptShardError(f"{path}: {view.num_samples} samples, commit record says {c.num_samples}")
        with self._lock:
            if verify:
                first = self._contents.setdefault(content_key(view, tensor_sum), k)
                if first != k:
                    view.close()
                    raise CorruptShardError(
                        f"{path}: same tensors as {self.commits[first].shard} (tensor bytes {tensor_sum}): the "
                        "samples were committed twice; refusing to read them twice (remove one of the two)")
            self._verified.add(k)
            self._open[k] = view
            while len(self._open) > self._max_open:   # dropped, not closed: a caller may still use it;
                self._open.popitem(last=False)         # the mapping goes with its last reference
        return view

    def sample(self, g: int, copy: bool = False) -> dict[str, torch.Tensor]:
        k, i = self.locate(g)
        return self.shard(k).sample(i, copy=copy)

    def num_tokens_of(self, g: int) -> int:
        k, i = self.locate(g)
        off = self.shard(k).offsets["tokens"]
        return int(off[i + 1] - off[i])

    def where(self, g: int) -> str:
        k, i = self.locate(g)
        return f"{self.commits[k].shard}[{i}]"

    def close(self) -> None:
        with self._lock:
            for view in self._open.values():
                view.close()
            self._open.clear()
