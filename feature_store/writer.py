"""``StoreWriter``: one per process (rank). Buffers validated samples, flushes them as one shard + commit
record by sample count, by bytes, and at step boundaries. No lock, no shared mutable file: the writer
id (``r<rank>-<random run id>``) is unique, and publication never overwrites (see store.py). A restarted
writer gets a new run id and continues next to what earlier runs committed (``previous_commits``).

Dtype policy (strict, buffer.py): a field's tensor must have the schema's kind; floats are cast to the
schema's float dtype (bf16 by default for hidden states, ``standard_schema(hidden_dtype=...)``), integers
to its integer dtype after a range check, bool<->integer only for 0/1 values. Floating data never
becomes integer data. ``copy_inputs=False`` buffers references instead of copies (see buffer.py)."""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Mapping
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np
import torch

from feature_store.buffer import FieldBuffer, bytes_view, convert_check
from feature_store.encoding import encode_fp8
from feature_store.errors import SampleError, StoreError
from feature_store.schema import STORE_SCALARS, TOKENS, FieldSpec, Schema, offsets_name, scale_name
from feature_store.shard import Entry, ShardStream, header_reserve, write_shard
from feature_store.store import (
    COMMIT_SUFFIX,
    SHARD_SUFFIX,
    SHARDS_DIR,
    STORE_FORMAT,
    TMP_PREFIX,
    CommitRecord,
    create_or_open_store,
    fsync_dir,
    list_commits,
    publish,
    write_durable,
)
from feature_store.validate import raise_problems, sample_problems


def lead_field(schema: Schema) -> FieldSpec | None:
    """The field streamed to the shard file at ``add`` time (``shard.ShardStream``): the per-token field with
    the largest rows as stored (an fp8 field's e4m3 values), if their size is a multiple of 8 (so the tensors
    after it stay aligned)."""
    fields = [f for f in schema.stored_fields if f.per_token and f.row_nbytes and f.row_nbytes % 8 == 0]
    return max(fields, key=lambda f: f.row_nbytes) if fields else None


class StoreWriter:
    """Append samples to the store at ``root`` (created if absent). Not thread-safe: one per process."""

    def __init__(self, root: str | os.PathLike[str], schema: Schema, *, rank: int = 0,
                 producer: Mapping[str, Any] | None = None, flush_samples: int = 1024,
                 flush_bytes: int = 256 << 20, flush_interval_steps: int = 1, check_values: bool = True,
                 copy_inputs: bool = True) -> None:
        for name, v, lo in (("rank", rank, 0), ("flush_samples", flush_samples, 1), ("flush_bytes", flush_bytes, 1),
                            ("flush_interval_steps", flush_interval_steps, 0)):
            if not isinstance(v, int) or v < lo:
                raise ValueError(f"StoreWriter {name}={v!r}: expected an int >= {lo}")
        self.root, self.schema, self.rank = Path(root), schema, rank
        self.flush_samples, self.flush_bytes = flush_samples, flush_bytes
        self.flush_interval_steps, self.check_values = flush_interval_steps, check_values
        self.meta = create_or_open_store(self.root, schema, dict(producer or {}))
        self._dir = self.root / SHARDS_DIR
        taken = os.listdir(self._dir)
        while True:
            self.run_id = secrets.token_hex(4)
            self.writer_id = f"r{rank:05d}-{self.run_id}"
            if not any(self.writer_id in n for n in taken):
                break
        self.previous_commits: list[CommitRecord] = list_commits(self.root, prefix=f"r{rank:05d}-")
        self.commits: list[CommitRecord] = []
        self.copy_inputs = copy_inputs
        self._lead = lead_field(schema)
        self._buffers = {f.name: FieldBuffer(f, copy_inputs) for f in schema.stored_fields if f is not self._lead}
        self._stream: ShardStream | None = None
        self._stream_seq = -1
        self._lengths: dict[str, list[int]] = {seg: [] for seg in schema.segments}
        self._steps: list[int] = []
        self._versions: list[int] = []
        self._seq = 0
        self._completed_step: int | None = None
        self._steps_since_flush = 0
        self._closed = False

    # -- adding -----------------------------------------------------------------------------------------
    def add(self, sample: Mapping[str, torch.Tensor | np.ndarray], *, step: int,
            policy_version: int = -1) -> CommitRecord | None:
        """Validate and buffer one sample (``{field: tensor}``; per-token fields ``[T, *shape]``).

        ``step`` is the global (RL) step, ``policy_version`` the weights version that produced the
        features (-1 = unknown). Returns the commit record when this sample triggered a flush.
        Nothing is buffered when validation fails."""
        self._check_open()
        for name, v in (("step", step), ("policy_version", policy_version)):
            if not isinstance(v, int) or isinstance(v, bool):
                raise SampleError(f"{name}={v!r}: expected an int")
        missing = [n for n in self.schema.names if n not in sample]
        unknown = sorted(set(sample) - set(self.schema.names))
        if missing or unknown:
            raise SampleError(f"sample fields: missing {missing}, unknown {unknown}; schema fields "
                              f"{list(self.schema.names)}")
        tensors: dict[str, torch.Tensor] = {}
        lengths: dict[str, int] = {}
        first: dict[str, str] = {}
        for spec in self.schema.fields:
            t = sample[spec.name]
            t = torch.from_numpy(t) if isinstance(t, np.ndarray) else t
            if not isinstance(t, torch.Tensor):
                raise SampleError(f"field {spec.name!r}: {type(t).__name__}, expected a torch.Tensor")
            lead = 1 if spec.per_token else 0
            if t.dim() != lead + len(spec.shape) or tuple(t.shape[lead:]) != spec.shape:
                raise SampleError(f"field {spec.name!r}: shape {list(t.shape)}, expected "
                                  f"{(['T'] if spec.per_token else []) + list(spec.shape)}")
            if spec.per_token:
                seg, n = spec.segment, t.shape[0]
                if seg in lengths and lengths[seg] != n:
                    raise SampleError(f"field {spec.name!r}: length {n}, field {first[seg]!r} has {lengths[seg]} "
                                      f"(segment {seg!r} fields must have equal lengths)")
                lengths.setdefault(seg, n)
                first.setdefault(seg, spec.name)
            convert_check(spec, t)
            tensors[spec.name] = t
        if lengths[TOKENS] == 0:
            raise SampleError(f"sample has 0 tokens (field {first[TOKENS]!r}); expected at least 1")
        physical, decoded = self._encode(tensors)
        marks = {n: b.mark() for n, b in self._buffers.items()}
        sizes = {spec.name: physical[spec.name].numel() * spec.torch_dtype.itemsize
                 for spec in self.schema.stored_fields}
        total = max(1, sum(sizes.values()))
        # expected peak of each buffer: a shard holds < flush_bytes + one sample, split like this sample
        # (x2 margin, as lengths vary); reserving it at once means growing rarely copies anything
        hints = {n: min(self.flush_samples * b * 2, int((self.flush_bytes + total) * min(1.0, 2 * b / total)))
                 for n, b in sizes.items()}
        try:
            stored = {name: buf.append(physical[name], hints[name]) for name, buf in self._buffers.items()}
            lead_t: torch.Tensor | None = None
            if self._lead is not None:
                lead_t = physical[self._lead.name].to(device="cpu", dtype=self._lead.torch_dtype).contiguous()
                stored[self._lead.name] = lead_t
            if self.check_values:   # an encoded field is checked as the value it encodes
                raise_problems(sample_problems(self.schema, {**stored, **decoded}),
                               f"sample {len(self._steps)} of {self.writer_id}")
            if lead_t is not None:                   # last: a failure here cuts the file back (ShardStream.append)
                stream = self._open_stream()
                if lead_t.numel():
                    stream.append(bytes_view(lead_t))
        except BaseException:
            for fname, buf in self._buffers.items():
                buf.rollback(marks[fname])
            raise
        for seg in self.schema.segments:
            self._lengths[seg].append(lengths[seg])
        self._steps.append(step)
        self._versions.append(policy_version)
        if len(self._steps) >= self.flush_samples or self.buffered_bytes >= self.flush_bytes:
            return self.flush()
        return None

    def _encode(self, tensors: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """(the tensors to store, by stored name; each encoded field's value in its dtype, by field name)."""
        physical: dict[str, torch.Tensor] = {}
        decoded: dict[str, torch.Tensor] = {}
        for spec in self.schema.fields:
            t = tensors[spec.name]
            if spec.encoding == "raw":
                physical[spec.name] = t
                continue
            x = t.to(device="cpu", dtype=spec.torch_dtype)        # the value a raw store would hold
            decoded[spec.name] = x
            q, scale = encode_fp8(x)
            physical[spec.name], physical[scale_name(spec.name)] = q, scale
        return physical, decoded

    def end_step(self, step: int) -> CommitRecord | None:
        """Mark step ``step`` complete; flushes every ``flush_interval_steps`` steps (0 = never here)."""
        self._check_open()
        self._completed_step = step
        self._steps_since_flush += 1
        if self.flush_interval_steps and self._steps_since_flush >= self.flush_interval_steps:
            return self.flush()
        return None

    @property
    def buffered_samples(self) -> int:
        return len(self._steps)

    @property
    def buffered_bytes(self) -> int:
        return sum(b.nbytes for b in self._buffers.values()) + (self._stream.lead_nbytes if self._stream else 0)

    def _open_stream(self) -> ShardStream:
        if self._stream is None:
            seq, self._seq = self._seq, self._seq + 1
            name = f"{self.writer_id}-{seq:08d}"
            reserve = header_reserve([(f.name, f.st_dtype, 1 + len(f.shape)) for f in self.schema.stored_fields]
                                     + [(offsets_name(seg), "I64", 1) for seg in self.schema.segments]
                                     + [(s, "I64", 1) for s in STORE_SCALARS], self._shard_meta(seq))
            self._stream = ShardStream(self._dir / f"{TMP_PREFIX}{name}{SHARD_SUFFIX}", reserve)
            self._stream_seq = seq
        return self._stream

    def _shard_meta(self, seq: int) -> dict[str, str]:
        return {"format": STORE_FORMAT, "schema_hash": self.schema.hash, "writer_id": self.writer_id,
                "seq": str(seq)}

    @property
    def last_completed_step(self) -> int | None:
        """Largest step every sample of which this rank committed (earlier runs included), or None."""
        done = [c.completed_step for c in self.previous_commits + self.commits if c.completed_step is not None]
        return max(done) if done else None

    # -- committing ---------------------------------------------------------------------------------------
    def flush(self) -> CommitRecord | None:
        """Write the buffer as one shard and commit it. When this returns, the samples are durable and
        visible to new readers. On failure the buffer is kept and nothing partial becomes visible."""
        self._check_open()
        self._steps_since_flush = 0
        n = len(self._steps)
        if n == 0:
            return None
        stream = self._stream
        if stream is not None:            # the shard file exists since the first add: its name is taken
            seq = self._stream_seq
        else:
            seq, self._seq = self._seq, self._seq + 1    # a failed flush never reuses its name
        name = f"{self.writer_id}-{seq:08d}"
        entries = [Entry(f.name, f.st_dtype, self._shape(f, n), self._buffers[f.name].chunks())
                   for f in self.schema.stored_fields if f is not self._lead]
        for seg, lens in self._lengths.items():
            entries.append(Entry(offsets_name(seg), "I64", (n + 1,), [np.concatenate([[0], np.cumsum(lens)])
                                 .astype(np.int64)]))
        for sname, vals in zip(STORE_SCALARS, (self._steps, self._versions)):
            entries.append(Entry(sname, "I64", (n,), [np.asarray(vals, dtype=np.int64)]))
        meta = self._shard_meta(seq)
        tmp_shard = self._dir / f"{TMP_PREFIX}{name}{SHARD_SUFFIX}"
        final_shard = self._dir / f"{name}{SHARD_SUFFIX}"
        tmp_commit = self._dir / f"{TMP_PREFIX}{name}{COMMIT_SUFFIX}"
        try:
            if stream is None:
                nbytes, checksum = write_shard(tmp_shard, entries, meta)
                publish(tmp_shard, final_shard)
            else:
                assert self._lead is not None
                if stream.result is None:
                    stream.finish(Entry(self._lead.name, self._lead.st_dtype, self._shape(self._lead, n), []),
                                  entries, meta)
                assert stream.result is not None
                nbytes, checksum = stream.result
                if not stream.published:
                    try:
                        publish(tmp_shard, final_shard)
                    finally:     # linked (a later step failed): a retry only redoes what follows the link
                        stream.published = final_shard.exists() and os.path.samestat(
                            os.stat(final_shard), os.fstat(stream.fd))
                else:
                    tmp_shard.unlink(missing_ok=True)
                    fsync_dir(self._dir)
            rec = CommitRecord(f"{name}{SHARD_SUFFIX}", self.writer_id, self.rank, self.run_id, seq, nbytes, checksum,
                               n, sum(self._lengths[TOKENS]), min(self._steps), max(self._steps),
                               min(self._versions), max(self._versions), self._completed_step, self.schema.hash,
                               time.time())
            write_durable(tmp_commit, rec.to_json())
            publish(tmp_commit, self._dir / f"{name}{COMMIT_SUFFIX}")
        except FileExistsError as e:
            raise StoreError(f"{e.filename}: already exists; refusing to overwrite (writer id collision)") from e
        finally:
            if stream is None:
                tmp_shard.unlink(missing_ok=True)
            tmp_commit.unlink(missing_ok=True)
        if stream is not None:
            stream.close()
            self._stream = None
        self.commits.append(rec)
        self._reset()
        return rec

    def _shape(self, spec: FieldSpec, n: int) -> tuple[int, ...]:
        rows = sum(self._lengths[spec.segment]) if spec.per_token else n
        return (rows, *spec.shape)

    def _reset(self) -> None:
        if self._stream is not None:      # after a flush: already closed and published; else dropped
            self._stream.discard()
            self._stream = None
        for buf in self._buffers.values():
            buf.reset()
        for lens in self._lengths.values():
            lens.clear()
        self._steps.clear()
        self._versions.clear()

    def close(self) -> None:
        """Flush what is buffered and release the buffers. Idempotent."""
        if not self._closed:
            self.flush()
            self._closed = True
            self._reset()           # an empty stream left by a rejected first sample
            self._buffers.clear()

    def _check_open(self) -> None:
        if self._closed:
            raise StoreError(f"StoreWriter {self.writer_id} is closed")

    def __enter__(self) -> StoreWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        """Normal exit flushes; on an exception the uncommitted buffer is dropped, as in a crash."""
        if exc_type is None:
            self.close()
        else:
            self._reset()
            self._closed = True
