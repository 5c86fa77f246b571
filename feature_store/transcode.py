"""Re-encode a store's hidden-state fields into a new store: the same samples in the same global order,
with the same steps and policy versions, one output shard per input shard (so a split by whole shards
selects the same samples in both). The source is read with its checksums verified.

    transcode_store("features", "features-fp8", "fp8_e4m3")   # e.g. bf16 -> fp8 (e4m3 + per-token scale)"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

from feature_store.errors import StoreError
from feature_store.index import StoreIndex
from feature_store.schema import ENCODINGS, Schema
from feature_store.store import load_store
from feature_store.writer import StoreWriter


def reencoded(schema: Schema, encoding: str, names: tuple[str, ...] = ("aux_hidden", "last_hidden")) -> Schema:
    """`schema` with the fields `names` (those present) stored as `encoding`."""
    if encoding not in ENCODINGS:
        raise ValueError(f"encoding={encoding!r}: expected one of {list(ENCODINGS)}")
    fields = tuple(replace(f, encoding=encoding) if f.name in names else f for f in schema.fields)
    return replace(schema, fields=fields)


def transcode_store(src: str | os.PathLike[str], dst: str | os.PathLike[str], encoding: str) -> int:
    """Write every committed sample of `src` into the new store `dst` with the hidden fields stored as
    `encoding`; returns the number of samples. `dst` must not hold a store yet."""
    meta = load_store(src)
    if (Path(dst) / "store.json").exists():
        raise StoreError(f"{dst}: a store is already there; expected a new directory")
    index = StoreIndex.open(src, verify_checksums=True)
    schema = reencoded(meta.schema, encoding)
    producer = {**meta.producer, "transcoded_from": str(Path(src).resolve()), "encoding": encoding}
    try:
        with StoreWriter(dst, schema, producer=producer, flush_samples=1 << 30, flush_bytes=1 << 62,
                         flush_interval_steps=0) as writer:
            g = 0
            for commit in index.commits:
                for _ in range(commit.num_samples):
                    sample = index.sample(g)
                    step, version = int(sample.pop("global_step")), int(sample.pop("policy_version"))
                    writer.add(sample, step=step, policy_version=version)
                    g += 1
                writer.flush()
    finally:
        index.close()
    return index.num_samples
