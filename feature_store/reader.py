"""``StoreReader``: endless, deterministic, resumable iteration over a store's committed samples.

- Order: epoch e of rank r is ``order.rank_order(n, seed, e, r, world_size, shuffle, remainder)``; the
  stream runs epoch after epoch forever. It never depends on ``prefetch``.
- Snapshot: the committed shards are listed once, at construction. New commits join only through
  ``refresh()``, and then at the next epoch boundary; all ranks must refresh at the same epoch with the
  same committed set, or pin one with ``shard_set=`` (e.g. rank 0's ``index.shard_set``, broadcast).
- Resume: ``state_dict()`` names the next sample (epoch, position) and the snapshot (``shard_set`` +
  fingerprint); ``load_state_dict`` rebuilds exactly that snapshot even if shards were committed since,
  and fails (``ResumeStateError``) if one of its shards is gone or changed, or a setting differs.
- Samples: ``dict[str, Tensor]`` (per-token fields ``[T, *shape]``, per-sample ``[*shape]``, plus 0-d int64
  ``global_step``/``policy_version``); zero-copy views of the mapped shard unless ``copy=True``.
- Prefetch: a background thread keeps ``prefetch`` samples ready (it opens shards, verifies checksums,
  hints the kernel to read the sample's pages, copies when ``copy=True``)."""

from __future__ import annotations

import os
import queue
import threading
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import numpy as np
import torch

from feature_store.errors import EmptyStoreError, ResumeStateError, SampleError
from feature_store.index import StoreIndex
from feature_store.order import REMAINDER_POLICIES, per_rank_count, rank_order
from feature_store.schema import TOKENS, FieldSpec, Layout
from feature_store.validate import raise_problems, sample_problems

STATE_VERSION = 1
_SETTINGS = ("seed", "rank", "world_size", "shuffle", "remainder")


@dataclass
class _Item:
    epoch: int
    pos: int
    g: int          # global sample index in ``index``
    sample: dict[str, torch.Tensor]
    num_tokens: int
    index: StoreIndex


class _Failure:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


class _Prefetcher:
    """Runs ``source`` in a daemon thread, ``depth`` items ahead, through a bounded queue."""

    def __init__(self, source: Iterator[_Item], depth: int) -> None:
        self._q: queue.Queue[_Item | _Failure] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._source = source
        self._thread = threading.Thread(target=self._run, name="feature-store-prefetch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for item in self._source:
                while not self._stop.is_set():
                    try:
                        self._q.put(item, timeout=0.05)
                        break
                    except queue.Full:
                        continue
                if self._stop.is_set():
                    return
        except BaseException as e:  # handed to the consumer, raised at the same stream position
            self._q.put(_Failure(e))

    def __iter__(self) -> _Prefetcher:
        return self

    def __next__(self) -> _Item:
        item = self._q.get()
        if isinstance(item, _Failure):
            raise item.exc
        return item

    def close(self) -> None:
        self._stop.set()
        while self._thread.is_alive():
            try:
                self._q.get(timeout=0.05)
            except queue.Empty:
                pass
        self._thread.join()


class StoreReader:
    def __init__(self, root: str | os.PathLike[str], *, seed: int = 0, rank: int = 0, world_size: int = 1,
                 shuffle: bool = True, remainder: str = "drop", expect_layout: Layout | None = None,
                 expect_fields: Iterable[str | FieldSpec] | None = None, prefetch: int = 2, copy: bool = False,
                 verify_checksums: bool = False, check_values: bool = False,
                 shard_set: Mapping[str, int] | None = None, max_open_shards: int = 64) -> None:
        if not (isinstance(world_size, int) and world_size >= 1 and isinstance(rank, int) and 0 <= rank < world_size):
            raise ValueError(f"rank={rank!r}, world_size={world_size!r}: expected 0 <= rank < world_size")
        if remainder not in REMAINDER_POLICIES:
            raise ValueError(f"remainder={remainder!r}: expected one of {REMAINDER_POLICIES}")
        if not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(f"prefetch={prefetch!r}: expected an int >= 0 (0 = no background thread)")
        self.root, self.seed, self.rank, self.world_size = root, int(seed), rank, world_size
        self.shuffle, self.remainder, self.prefetch, self.copy = shuffle, remainder, prefetch, copy
        self.verify_checksums, self.check_values, self._max_open = verify_checksums, check_values, max_open_shards
        self.index = self._open_index(shard_set)
        self.schema = self.index.schema
        if expect_layout is not None:
            self.schema.layout.check_matches(expect_layout)
        if expect_fields is not None:
            self.schema.check_fields(expect_fields)
        if shard_set is not None and self.index.shard_set != dict(shard_set):
            raise ResumeStateError(f"{root}: pinned shard_set {dict(shard_set)} is not committed; the store has "
                                   f"{self.index.shard_set} of those writers")
        self._check_nonempty(self.index)
        self._epoch, self._pos = 0, 0
        self._pending: tuple[StoreIndex, int] | None = None
        self._stream: Iterator[_Item] | None = None
        self._peeked: _Item | None = None

    def _open_index(self, shard_set: Mapping[str, int] | None) -> StoreIndex:
        return StoreIndex.open(self.root, shard_set=shard_set, verify_checksums=self.verify_checksums,
                               max_open_shards=self._max_open)

    def _check_nonempty(self, index: StoreIndex) -> None:
        n = index.num_samples
        if n == 0:
            raise EmptyStoreError(f"{self.root}: no committed samples")
        if per_rank_count(n, self.world_size, self.remainder) == 0:
            raise EmptyStoreError(f"{self.root}: {n} samples over world_size={self.world_size} leave rank "
                                  f"{self.rank} none under remainder='drop'; use remainder='wrap'")

    def __len__(self) -> int:
        """Samples this rank reads per epoch (of the current snapshot)."""
        return per_rank_count(self.index.num_samples, self.world_size, self.remainder)

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def position(self) -> int:
        return self._pos

    def epoch_order(self, epoch: int, index: StoreIndex | None = None) -> np.ndarray:
        """Global sample indices (of ``index``, default the current snapshot) this rank reads in ``epoch``."""
        idx = index or self.index
        return rank_order(idx.num_samples, seed=self.seed, epoch=epoch, rank=self.rank,
                          world_size=self.world_size, shuffle=self.shuffle, remainder=self.remainder)

    # -- the stream ------------------------------------------------------------------------------------------
    def _produce(self, index: StoreIndex, pending: tuple[StoreIndex, int] | None, epoch: int,
                 pos: int) -> Iterator[_Item]:
        tokens_field = next(f.name for f in self.schema.fields if f.per_token and f.segment == TOKENS)
        while True:
            if pending is not None and epoch >= pending[1]:
                index, pending = pending[0], None
            order = self.epoch_order(epoch, index)
            while pos < len(order):
                g = int(order[pos])
                sample = index.sample(g, copy=self.copy)
                if self.check_values:
                    raise_problems(sample_problems(self.schema, sample), index.where(g))
                yield _Item(epoch, pos, g, sample, int(sample[tokens_field].shape[0]), index)
                pos += 1
            epoch, pos = epoch + 1, 0

    def _peek(self) -> _Item:
        if self._peeked is None:
            if self._stream is None:
                source = self._produce(self.index, self._pending, self._epoch, self._pos)
                self._stream = _Prefetcher(source, self.prefetch) if self.prefetch else source
            try:
                self._peeked = next(self._stream)
            except BaseException:
                self._stop_stream()   # the next call restarts at the same sample (and fails the same way)
                raise
        return self._peeked

    def _consume(self, item: _Item) -> None:
        self._epoch, self._pos = item.epoch, item.pos + 1
        if item.index is not self.index:      # crossed into the epoch where a refresh takes effect
            self.index, self._pending = item.index, None
        self._peeked = None

    def _stop_stream(self) -> None:
        if isinstance(self._stream, _Prefetcher):
            self._stream.close()
        self._stream, self._peeked = None, None

    def iter_samples(self) -> Iterator[dict[str, torch.Tensor]]:
        """Endless: one sample at a time, epoch after epoch."""
        while True:
            item = self._peek()
            self._consume(item)
            yield item.sample

    __iter__ = iter_samples

    def iter_batches(self, token_budget: int, *, oversize: str = "alone",
                     max_samples: int | None = None) -> Iterator[list[dict[str, torch.Tensor]]]:
        """Endless: consecutive samples of the stream grouped while their total tokens fit ``token_budget``
        (and at most ``max_samples``). A sample longer than the budget goes in a batch of its own
        (``oversize="alone"``) or raises ``SampleError`` without being consumed (``oversize="error"``).
        Batches may span an epoch boundary."""
        if token_budget < 1 or oversize not in ("alone", "error"):
            raise ValueError(f"token_budget={token_budget}, oversize={oversize!r}: expected >= 1 and 'alone'|'error'")
        while True:
            batch: list[dict[str, torch.Tensor]] = []
            used = 0
            while max_samples is None or len(batch) < max_samples:
                item = self._peek()
                if item.num_tokens > token_budget:
                    if oversize == "error":
                        raise SampleError(f"{item.index.where(item.g)}: "
                                          f"{item.num_tokens} tokens, over token_budget={token_budget}")
                    if batch:
                        break
                    self._consume(item)
                    batch.append(item.sample)
                    break
                if used + item.num_tokens > token_budget:
                    break
                self._consume(item)
                batch.append(item.sample)
                used += item.num_tokens
            yield batch

    # -- resume -----------------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The next sample to hand out and the snapshot it comes from (JSON-serialisable)."""
        return {"version": STATE_VERSION, "epoch": self._epoch, "position": self._pos, "seed": self.seed,
                "rank": self.rank, "world_size": self.world_size, "shuffle": self.shuffle,
                "remainder": self.remainder, "num_samples": self.index.num_samples,
                "shard_set": self.index.shard_set, "fingerprint": self.index.fingerprint}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        missing = [k for k in self.state_dict() if k not in state]
        if missing:
            raise ResumeStateError(f"reader state: missing keys {missing}")
        if state["version"] != STATE_VERSION:
            raise ResumeStateError(f"reader state version {state['version']!r}, expected {STATE_VERSION}")
        for k in _SETTINGS:
            if state[k] != getattr(self, k):
                raise ResumeStateError(f"reader state {k}={state[k]!r}, this reader has {k}={getattr(self, k)!r}")
        index = self._open_index(state["shard_set"])
        if index.num_samples != state["num_samples"] or index.fingerprint != state["fingerprint"]:
            raise ResumeStateError(
                f"{self.root}: the committed shards changed since the state was saved: state has "
                f"{state['num_samples']} samples (fingerprint {state['fingerprint']}), the same writers' shards "
                f"now hold {index.num_samples} (fingerprint {index.fingerprint}); a shard was removed or replaced")
        per = per_rank_count(index.num_samples, self.world_size, self.remainder)
        if not (isinstance(state["epoch"], int) and state["epoch"] >= 0 and 0 <= state["position"] <= per):
            raise ResumeStateError(f"reader state epoch={state['epoch']!r} position={state['position']!r}: "
                                   f"expected epoch >= 0 and 0 <= position <= {per}")
        self._stop_stream()
        self.index, self._pending = index, None
        self._epoch, self._pos = state["epoch"], state["position"]

    def refresh(self) -> bool:
        """Adopt newly committed shards from the next epoch on. True if there were any."""
        new = self._open_index(None)
        if new.fingerprint == self.index.fingerprint:
            return False
        self._check_nonempty(new)
        self._stop_stream()
        self._pending = (new, self._epoch + 1)
        return True

    def close(self) -> None:
        self._stop_stream()
        self.index.close()

    def __enter__(self) -> StoreReader:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
