"""Training and held-out data from the Feature Store, as collated micro-batches on the device.

- Training: one `StoreReader` per rank; a micro-batch is `data.micro_batch_size` consecutive samples
  of the rank's stream or, with `data.token_budget`, token-budget packing; samples are cut to
  `max_seq_len`. Each sample's `aux_hidden` is cut to the family's layer ids in its order
  (`select_layout`: one store may serve several families); every shard's checksum is verified when
  first opened (`data.verify_checksums`).
- Held-out: `data.eval_store`, or with `data.eval_fraction` > 0 the last whole shards of every writer
  of `data.store` (excluded from training by pinning the prefix `shard_set`). Every rank runs the
  same number of eval forwards."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
from torch import Tensor

from feature_store import ChecksumError, Layout, LayoutMismatchError, StoreIndex, StoreReader
from feature_store.layout_select import LayoutSelection, select_layout
from feature_store.store import list_commits, load_store
from verl_speco.train.config import ConfigError, DataSection

Sample = dict[str, Tensor]
T = TypeVar("T")


def _checksum_hint(batches: Iterator[T]) -> Iterator[T]:
    """Re-raise a shard checksum mismatch with the setting that skips the check."""
    try:
        yield from batches
    except ChecksumError as err:
        raise ChecksumError(f"{err}; data.verify_checksums=false reads the store without this check") from err


def truncate(sample: Sample, max_len: int) -> Sample:
    """Cut every per-token field ([T, ...], T = len(input_ids)) to its first `max_len` rows."""
    t = int(sample["input_ids"].shape[0])
    if t <= max_len:
        return sample
    return {k: (v[:max_len] if v.dim() >= 1 and v.shape[0] == t else v) for k, v in sample.items()}


def train_shard_set(cfg: DataSection) -> tuple[dict[str, int] | None, list[Any]]:
    """(shard_set pinned for training or None, held-out commit records) for `eval_fraction`.

    Whole shards are held out from the tail of each writer, writers taken round-robin (sorted by
    id), until the held-out samples reach `eval_fraction` of the store; every writer keeps its
    first shard. Example: 4 shards of 8 samples from one writer, eval_fraction 0.25 -> train on
    seq 0-2 (shard_set {writer: 3}), evaluate on seq 3."""
    if cfg.eval_store is not None or cfg.eval_fraction <= 0:
        return None, []
    by_writer: dict[str, list[Any]] = {}
    for c in sorted(list_commits(cfg.store), key=lambda c: (c.writer_id, c.seq)):
        by_writer.setdefault(c.writer_id, []).append(c)
    target = cfg.eval_fraction * sum(c.num_samples for cs in by_writer.values() for c in cs)
    kept = {w: len(cs) for w, cs in by_writer.items()}
    held_samples, progress = 0, True
    while held_samples < target and progress:
        progress = False
        for w in sorted(by_writer):
            if held_samples < target and kept[w] > 1:
                kept[w] -= 1
                held_samples += by_writer[w][kept[w]].num_samples
                progress = True
    held = [c for w, cs in by_writer.items() for c in cs[kept[w]:]]
    if not held:
        raise ConfigError(f"data.eval_fraction={cfg.eval_fraction}: {cfg.store} has one shard per writer "
                         f"({len(by_writer)} writer(s)); whole shards are held out and every writer keeps "
                         "its first one, so nothing is left for evaluation: pass data.eval_store or write "
                         "the store in more shards")
    return {w: cs[kept[w] - 1].seq + 1 for w, cs in by_writer.items()}, held


def layout_selection(store: object, store_layout: Layout, layout: Layout) -> LayoutSelection:
    """How the store at `store` (layout `store_layout`) serves `layout`; `LayoutMismatchError`
    naming the store, the missing layer ids and both layouts when it cannot."""
    try:
        return select_layout(store_layout, layout)
    except LayoutMismatchError as err:
        raise LayoutMismatchError(f"{store}: {err}") from err


def _selector(source: StoreReader | StoreIndex, layout: Layout | None) -> Callable[[Sample], Sample]:
    if layout is None:
        return lambda s: s
    sel = layout_selection(source.root, source.schema.layout, layout)
    return (lambda s: s) if sel.identity else sel.apply


def open_train_reader(cfg: DataSection, rank: int, world_size: int, layout: Layout,
                      fields: tuple[str, ...], shard_set: dict[str, int] | None) -> StoreReader:
    """This rank's reader of `data.store`, which must serve `layout` (its layers or more) and hold
    `fields` (`aux_hidden` is not asked of a store when `layout` has no layer ids)."""
    reader = StoreReader(cfg.store, seed=cfg.seed, rank=rank, world_size=world_size, shuffle=cfg.shuffle,
                         expect_fields=store_fields(fields, layout), prefetch=cfg.prefetch,
                         verify_checksums=cfg.verify_checksums, shard_set=shard_set)
    try:
        layout_selection(cfg.store, reader.schema.layout, layout)
    except LayoutMismatchError:
        reader.close()
        raise
    return reader


def store_fields(fields: tuple[str, ...], layout: Layout) -> tuple[str, ...]:
    """The fields a store must hold for a family: `aux_hidden` only when `layout` has layer ids."""
    return fields if layout.layer_ids else tuple(f for f in fields if f != "aux_hidden")


def open_eval_index(cfg: DataSection, held: list[Any], layout: Layout, fields: tuple[str, ...]) -> StoreIndex | None:
    if cfg.eval_store is not None:
        index = StoreIndex.open(cfg.eval_store, verify_checksums=cfg.verify_checksums)
    elif held:
        index = StoreIndex(cfg.store, load_store(cfg.store), held, verify_checksums=cfg.verify_checksums)
    else:
        return None
    layout_selection(index.root, index.schema.layout, layout)
    index.schema.check_fields(store_fields(fields, layout))
    return index


def micro_batches(reader: StoreReader, cfg: DataSection, layout: Layout | None = None) -> Iterator[list[Sample]]:
    """Endless stream of this rank's micro-batches (lists of truncated samples), `aux_hidden` cut to
    `layout`'s layer ids when given (None: as stored)."""
    return _checksum_hint(_micro_batches(reader, cfg, _selector(reader, layout)))


def _micro_batches(reader: StoreReader, cfg: DataSection, select: Callable[[Sample], Sample]) -> Iterator[list[Sample]]:
    if cfg.token_budget is not None:
        for group in reader.iter_batches(cfg.token_budget):
            yield [truncate(select(s), cfg.max_seq_len) for s in group]
        return
    stream = reader.iter_samples()
    while True:
        yield [truncate(select(next(stream)), cfg.max_seq_len) for _ in range(cfg.micro_batch_size)]


def eval_batches(index: StoreIndex, cfg: DataSection, rank: int, world_size: int,
                 layout: Layout | None = None) -> Iterator[list[Sample]]:
    """This rank's held-out micro-batches (`aux_hidden` cut to `layout` as in `micro_batches`);
    every rank yields the same number of batches."""
    select = _selector(index, layout)
    n = (min(cfg.eval_samples, index.num_samples) // world_size) * world_size
    mine = list(range(rank, n, world_size))
    batches = ([truncate(select(index.sample(g, copy=True)), cfg.max_seq_len) for g in mine[i:i + cfg.micro_batch_size]]
               for i in range(0, len(mine), cfg.micro_batch_size))
    return _checksum_hint(batches)


def to_device(batch: dict[str, Tensor], device: torch.device) -> dict[str, Tensor]:
    return {k: v.to(device, non_blocking=True) for k, v in batch.items()}


def count_tokens(batch: dict[str, Tensor]) -> Tensor:
    """Real (unpadded) tokens of a collated batch, a 0-d tensor on the batch's device."""
    if "attention_mask" in batch:
        return batch["attention_mask"].sum()
    return torch.tensor(batch["input_ids"].numel(), device=batch["input_ids"].device)
