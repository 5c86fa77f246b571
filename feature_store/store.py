"""On-disk layout of a store (docs/design/formats.md section 1), atomic file publication, ``store.json``
and commit records.

```
<root>/store.json                              written once: format, schema, schema hash, producer
<root>/shards/<writer-id>-<seq>.safetensors    a shard (invisible until its commit record exists)
<root>/shards/<writer-id>-<seq>.commit.json    commit record (file name, bytes, checksum, counts...)
<root>/shards/.tmp-*                           in-flight temporaries (never read)
```

Publication never overwrites: a temp file is fsynced, hard-linked to its final name (``os.link``
fails if the name exists), unlinked, and the directory fsynced. No lock and no shared mutable file."""

from __future__ import annotations

import json
import os
import secrets
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from feature_store.errors import CorruptShardError, SchemaDriftError, SchemaError, StoreNotFoundError
from feature_store.schema import Schema

STORE_FORMAT = "verl-speco-feature-store"
STORE_FORMAT_VERSION = 1
STORE_JSON = "store.json"
SHARDS_DIR = "shards"
SHARD_SUFFIX = ".safetensors"
COMMIT_SUFFIX = ".commit.json"
TMP_PREFIX = ".tmp-"


def fsync_dir(path: str | os.PathLike[str]) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def publish(tmp: Path, final: Path) -> None:
    """Atomically give the durable file ``tmp`` the name ``final``; ``FileExistsError`` if taken."""
    os.link(tmp, final)
    os.unlink(tmp)
    fsync_dir(final.parent)


def write_durable(path: Path, data: bytes) -> None:
    """Create ``path`` exclusively, write ``data``, fsync."""
    with open(path, "xb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _dump(obj: Any) -> bytes:
    return (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode()


@dataclass(frozen=True)
class StoreMeta:
    """Contents of ``store.json``."""

    schema: Schema
    schema_hash: str
    producer: dict[str, Any]
    created_at: float
    format_version: int = STORE_FORMAT_VERSION

    def to_dict(self) -> dict[str, Any]:
        return {"format": STORE_FORMAT, "format_version": self.format_version, "schema": self.schema.to_dict(),
                "schema_hash": self.schema_hash, "producer": self.producer, "created_at": self.created_at}


def load_store(root: str | os.PathLike[str]) -> StoreMeta:
    """Read ``store.json``; ``StoreNotFoundError`` if absent, ``SchemaError`` if not a valid store file."""
    path = Path(root) / STORE_JSON
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise StoreNotFoundError(f"{path}: no store.json (not a Feature Store, or the wrong path)") from None
    try:
        d = json.loads(raw)
        if d.get("format") != STORE_FORMAT:
            raise SchemaError(f"{path}: format {d.get('format')!r}, expected {STORE_FORMAT!r}")
        if d.get("format_version") != STORE_FORMAT_VERSION:
            raise SchemaError(f"{path}: format_version {d.get('format_version')!r}, "
                              f"this code reads {STORE_FORMAT_VERSION}")
        schema = Schema.from_dict(d["schema"])
        meta = StoreMeta(schema, d["schema_hash"], dict(d.get("producer", {})), float(d["created_at"]))
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        if isinstance(e, SchemaError):
            raise
        raise SchemaError(f"{path}: unreadable store.json ({type(e).__name__}: {e})") from e
    if meta.schema_hash != schema.hash:
        raise SchemaError(f"{path}: schema_hash {meta.schema_hash!r} does not match its schema "
                          f"(hash {schema.hash!r}); the file was edited by hand")
    return meta


def create_or_open_store(root: str | os.PathLike[str], schema: Schema, producer: dict[str, Any]) -> StoreMeta:
    """Create ``store.json`` once (atomic create-if-absent), or check the existing one has ``schema``.

    Two writers racing both succeed when their schemas agree; otherwise the loser raises
    ``SchemaDriftError`` listing the differences (store value vs writer value)."""
    root = Path(root)
    (root / SHARDS_DIR).mkdir(parents=True, exist_ok=True)
    final = root / STORE_JSON
    if not final.exists():
        producer = {"hostname": socket.gethostname(), "pid": os.getpid(), **producer}
        meta = StoreMeta(schema, schema.hash, producer, time.time())
        tmp = root / f"{TMP_PREFIX}store-{secrets.token_hex(6)}.json"
        write_durable(tmp, _dump(meta.to_dict()))
        try:
            publish(tmp, final)
            return meta
        except FileExistsError:
            tmp.unlink()          # lost the race: compare with the winner's schema below
    meta = load_store(root)
    if meta.schema_hash != schema.hash:
        raise SchemaDriftError(f"{final}: schema drift, store hash {meta.schema_hash} vs writer hash "
                               f"{schema.hash} (store vs writer): " + "; ".join(meta.schema.diff(schema)))
    return meta


@dataclass(frozen=True)
class CommitRecord:
    """One shard's commit record (``<writer-id>-<seq>.commit.json``)."""

    shard: str                 # file name inside shards/
    writer_id: str
    rank: int
    run_id: str
    seq: int
    nbytes: int
    checksum: str              # "s64x4k:<32 hex>" over the whole shard file (checksum.py)
    num_samples: int
    num_tokens: int
    min_step: int
    max_step: int
    min_policy_version: int
    max_policy_version: int
    completed_step: int | None  # every step <= this, ended by end_step() in this run, is fully committed
    schema_hash: str
    created_at: float

    @property
    def name(self) -> str:
        return self.shard[: -len(SHARD_SUFFIX)]

    def to_json(self) -> bytes:
        return _dump({"format": STORE_FORMAT, **asdict(self)})

    @classmethod
    def load(cls, path: Path) -> CommitRecord:
        try:
            d = json.loads(path.read_bytes())
            d.pop("format")
            rec = cls(**d)
            writer_id, shard = f"r{rec.rank:05d}-{rec.run_id}", f"{rec.writer_id}-{rec.seq:08d}{SHARD_SUFFIX}"
        except (ValueError, KeyError, TypeError) as e:
            raise CorruptShardError(f"{path}: unreadable commit record ({type(e).__name__}: {e})") from e
        if rec.shard != path.name[: -len(COMMIT_SUFFIX)] + SHARD_SUFFIX:
            raise CorruptShardError(f"{path}: commit record names shard {rec.shard!r}, expected "
                                    f"{path.name[: -len(COMMIT_SUFFIX)] + SHARD_SUFFIX!r}")
        if rec.writer_id != writer_id:
            raise CorruptShardError(f"{path}: commit record writer_id {rec.writer_id!r}, expected {writer_id!r} "
                                    f"(from rank {rec.rank} and run_id {rec.run_id!r})")
        if rec.shard != shard:
            raise CorruptShardError(f"{path}: commit record writer_id {rec.writer_id!r} and seq {rec.seq} give "
                                    f"shard {shard!r}, the record is for {rec.shard!r}")
        return rec


def list_commits(root: str | os.PathLike[str], prefix: str = "") -> list[CommitRecord]:
    """Every commit record in the store (whose name starts with ``prefix``), sorted by shard name."""
    d = Path(root) / SHARDS_DIR
    if not d.is_dir():
        return []
    names = sorted(n for n in os.listdir(d) if n.endswith(COMMIT_SUFFIX) and n.startswith(prefix)
                   and not n.startswith(TMP_PREFIX))
    return [CommitRecord.load(d / n) for n in names]


@dataclass
class DirScan:
    """Files under ``shards/`` sorted by role (for inspection and leftovers)."""

    commits: list[str]
    shards: list[str]
    temps: list[str]
    others: list[str]

    @property
    def uncommitted_shards(self) -> list[str]:
        committed = {c[: -len(COMMIT_SUFFIX)] + SHARD_SUFFIX for c in self.commits}
        return [s for s in self.shards if s not in committed]


def scan_dir(root: str | os.PathLike[str]) -> DirScan:
    scan = DirScan([], [], [], [])
    d = Path(root) / SHARDS_DIR
    for n in sorted(os.listdir(d) if d.is_dir() else []):
        if n.startswith(TMP_PREFIX):
            scan.temps.append(n)
        elif n.endswith(COMMIT_SUFFIX):
            scan.commits.append(n)
        elif n.endswith(SHARD_SUFFIX):
            scan.shards.append(n)
        else:
            scan.others.append(n)
    return scan
