"""Is a committed shard the one its commit record describes, and is a shard committed twice?

- The writer records its writer id and sequence number in the shard's header (``__metadata__``:
  ``writer_id``, ``seq``) and in the commit record, where they also give the file names
  (``store.CommitRecord.load`` checks ``<writer_id>-<seq:08d>`` and ``writer_id = r<rank:05d>-<run_id>``).
  A shard copied or renamed under another writer id or sequence number keeps its header:
  ``header_mismatch`` catches it from the header alone (no tensor byte read).
- Two files with the same bytes have the same header, and no two commit records have the same
  (writer id, seq), so at most one of two byte-identical committed shards agrees with its record: the
  header check alone refuses every byte-for-byte copy. What it cannot see is a copy whose header was
  rewritten too (the same tensors under a new, consistent header and a new checksum). ``content_key``
  identifies a shard's tensors (their table: names, dtypes, shapes, offsets from the first tensor byte;
  and the ``s64x4k`` of the tensor bytes, computed in the checksum's read: ``shard.shard_checksums``),
  so it is known wherever checksums are verified; two shards with equal keys hold the same samples.
"""

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
