"""Is a committed shard the one its commit record describes, and is a shard committed twice?

The writer records its writer id and sequence number in the shard's header and in the commit record,
so ``header_mismatch`` catches a shard copied or renamed under another name from the header alone,
which refuses every byte-for-byte copy (no two records share a (writer id, seq)). A copy whose header
was rewritten too is caught by ``content_key``: the shard's tensor table plus a digest of the tensor
bytes computed in the checksum's read, so two shards with equal keys hold the same samples."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping

from feature_store.shard import ShardView
from feature_store.store import CommitRecord


def header_mismatch(rec: CommitRecord, meta: Mapping[str, str]) -> str | None:
    """None when the shard header ``meta`` has the writer id and seq of ``rec``; else what differs."""
    want: dict[str, object] = {"writer_id": rec.writer_id, "seq": rec.seq}
    diffs = [f"header {k} {meta.get(k)!r}, commit record says {v!r}" for k, v in want.items()
             if meta.get(k) != str(v)]
    if not diffs:
        return None
    return ("; ".join(diffs) + " (the shard was written under another writer id or sequence number and "
            "copied or renamed: this commit record is not its own)")


def content_key(view: ShardView, tensor_checksum: str) -> str:
    """Identity of the tensors of ``view`` whose bytes (the file after its header) have ``tensor_checksum``."""
    infos = sorted(view.infos.items(), key=lambda kv: kv[1].begin)
    start = infos[0][1].begin if infos else 0
    table = [[name, t.st_dtype, list(t.shape), t.begin - start, t.end - start] for name, t in infos]
    digest = hashlib.sha256(json.dumps(table, separators=(",", ":")).encode()).hexdigest()[:16]
    return f"{tensor_checksum}/{digest}"
