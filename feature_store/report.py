"""Store inspection as data: ``inspect_store(root)`` -> ``Report`` (summary, per-shard rows, findings).

Per commit record: parseable and naming its own shard, schema hash = store's, shard present, byte size =
commit's, header valid for the schema, header writer id and seq = commit's (``header_mismatch``: a shard
copied or renamed under another name), sample/token counts and step range = commit's, and
(``verify_checksums``) checksum = commit's. Across records (``duplicate_content``, reported on every shard
but the first of a group, preferring one whose header agrees): the same checksum in two records (a
byte-for-byte copy), and with ``verify_checksums`` the same tensors (provenance.py ``content_key``; found
even when the copy's header and checksum were rewritten).
Sampled samples (a deterministic spread, all when ``max_samples=0`` or the store is smaller): values
finite, masks 0/1 and not empty, token ids in ``[0, vocab_size)``, at least one token.
Files that are not committed (temporaries, shards without a commit record, unknown names) are
warnings: they are invisible to readers. An unusable store (no/invalid ``store.json``) raises."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from feature_store.errors import ChecksumError, CorruptShardError, SchemaDriftError
from feature_store.order import permutation
from feature_store.provenance import content_key, header_mismatch
from feature_store.shard import ShardView, shard_checksums
from feature_store.store import (
    SHARDS_DIR,
    STORE_FORMAT,
    STORE_JSON,
    TMP_PREFIX,
    CommitRecord,
    StoreMeta,
    load_store,
    scan_dir,
)
from feature_store.validate import sample_problems

T = TypeVar("T")
Progress = Callable[[Iterable[T], int, str], Iterable[T]]


def _no_progress(it: Iterable[T], total: int, desc: str) -> Iterable[T]:
    return it


@dataclass(frozen=True)
class Finding:
    level: str      # "error" (a problem) | "warning" (not visible to readers, reported)
    kind: str
    where: str
    message: str


@dataclass
class Report:
    store: str
    summary: dict[str, Any]
    shards: list[dict[str, Any]] = field(default_factory=list)
    findings: list[Finding] = field(default_factory=list)
    samples_checked: int = 0
    checksums_verified: bool = False

    @property
    def errors(self) -> list[Finding]:
        return [f for f in self.findings if f.level == "error"]

    @property
    def warnings(self) -> list[Finding]:
        return [f for f in self.findings if f.level == "warning"]

    def to_dict(self) -> dict[str, Any]:
        return {"store": self.store, "summary": self.summary, "shards": self.shards,
                "samples_checked": self.samples_checked, "checksums_verified": self.checksums_verified,
                "errors": [asdict(f) for f in self.errors], "warnings": [asdict(f) for f in self.warnings]}


def _check_shard(root: Path, rec: CommitRecord, meta: StoreMeta, verify: bool,
                 report: Report) -> tuple[ShardView | None, str | None]:
    """(the view when a reader would read the shard, else None; the shard's identity for the duplicate
    check: its tensors' ``content_key`` when verified, its record's checksum otherwise; None if unreadable)."""
    path = root / SHARDS_DIR / rec.shard
    where = f"{SHARDS_DIR}/{rec.shard}"

    def err(kind: str, msg: str) -> None:
        report.findings.append(Finding("error", kind, where, msg))
    if rec.schema_hash != meta.schema_hash:
        err("schema_drift", f"committed with schema hash {rec.schema_hash}, store.json has {meta.schema_hash}")
        return None, None
    if not path.exists():
        err("missing_shard", "commit record present, shard file missing")
        return None, None
    try:
        view = ShardView(path, meta.schema, expect_nbytes=rec.nbytes)
    except SchemaDriftError as e:
        err("schema_drift", str(e))
        return None, None
    except CorruptShardError as e:
        err("truncated" if "bytes on disk" in str(e) else "bad_shard", str(e))
        return None, None
    lens = view.lengths
    steps = view.scalars["global_step"]
    found = (view.num_samples, int(lens.sum()), int(steps.min()), int(steps.max()))
    expect = (rec.num_samples, rec.num_tokens, rec.min_step, rec.max_step)
    if found != expect:
        err("commit_mismatch", f"(samples, tokens, min step, max step) = {found}, commit record says {expect}")
    key = f"checksum {rec.checksum}"
    if verify:
        got, tensor_sum = shard_checksums(path)
        if got != rec.checksum:
            err("checksum", str(ChecksumError(f"checksum {got}, commit record says {rec.checksum}")))
            return None, None
        key = f"tensors {content_key(view, tensor_sum)}"
    mismatch = header_mismatch(rec, view.meta)
    if mismatch is not None:
        err("header_mismatch", mismatch)
        return None, key
    return view, key


def _duplicates(keyed: list[tuple[CommitRecord, str, bool]], report: Report) -> None:
    """``duplicate_content`` on every shard of a group of equal keys but its first (a genuine one first)."""
    groups: dict[str, list[tuple[CommitRecord, bool]]] = {}
    for rec, key, genuine in keyed:
        groups.setdefault(key, []).append((rec, genuine))
    dropped: set[str] = set()
    for key, members in groups.items():
        if len(members) < 2:
            continue
        first = next((r for r, genuine in members if genuine), members[0][0])
        what, value = key.split(" ", 1)
        for rec, _ in members:
            if rec is first:
                continue
            dropped.add(rec.shard)
            same = (f"same tensors as {SHARDS_DIR}/{first.shard} (tensor bytes and table {value}): committed "
                    "twice (a reader verifying checksums refuses the second one it opens)" if what == "tensors"
                    else f"same checksum as {SHARDS_DIR}/{first.shard} in its commit record ({value}): a "
                    "byte-for-byte copy (readers refuse it by its header) or a wrong checksum (--verify-checksums)")
            report.findings.append(Finding("error", "duplicate_content", f"{SHARDS_DIR}/{rec.shard}", same))
    for row in report.shards:
        if row["shard"] in dropped:
            row["ok"] = False


def _leftovers(root: Path, report: Report) -> list[str]:
    scan = scan_dir(root)
    for name in scan.temps:
        report.findings.append(Finding("warning", "uncommitted_temp", f"{SHARDS_DIR}/{name}",
                                       "temporary file of an interrupted or running write (ignored by readers)"))
    for name in scan.uncommitted_shards:
        report.findings.append(Finding("warning", "uncommitted_shard", f"{SHARDS_DIR}/{name}",
                                       "shard without commit record (ignored by readers)"))
    for name in scan.others:
        report.findings.append(Finding("warning", "unknown_file", f"{SHARDS_DIR}/{name}", "not a store file"))
    for name in sorted(os.listdir(root)):
        if name not in (STORE_JSON, SHARDS_DIR):
            kind = "uncommitted_temp" if name.startswith(TMP_PREFIX) else "unknown_file"
            report.findings.append(Finding("warning", kind, name, "not part of the committed store"))
    return scan.commits


def inspect_store(root: str | os.PathLike[str], *, max_samples: int = 256, verify_checksums: bool = False,
                  progress: Progress[Any] = _no_progress) -> Report:
    """Check the store; raises ``StoreNotFoundError``/``SchemaError`` when it is unusable."""
    root = Path(root)
    meta = load_store(root)
    schema = meta.schema
    report = Report(str(root), {}, checksums_verified=verify_checksums)
    commit_names = _leftovers(root, report)
    good: list[tuple[CommitRecord, ShardView]] = []
    records: list[CommitRecord] = []
    keyed: list[tuple[CommitRecord, str, bool]] = []
    for name in progress(commit_names, len(commit_names), "shards"):
        try:
            rec = CommitRecord.load(root / SHARDS_DIR / name)
        except CorruptShardError as e:
            report.findings.append(Finding("error", "bad_commit", f"{SHARDS_DIR}/{name}", str(e)))
            continue
        records.append(rec)
        view, key = _check_shard(root, rec, meta, verify_checksums, report)
        report.shards.append({"shard": rec.shard, "samples": rec.num_samples, "tokens": rec.num_tokens,
                              "bytes": rec.nbytes, "steps": [rec.min_step, rec.max_step], "ok": view is not None})
        if view is not None:
            good.append((rec, view))
        if key is not None:
            keyed.append((rec, key, view is not None))
    _duplicates(keyed, report)
    total = sum(v.num_samples for _, v in good)
    picks = sorted(permutation(total, 0, 0)[: max_samples or total].tolist())
    starts, k, acc = [], 0, 0
    for _, v in good:
        starts.append(acc)
        acc += v.num_samples
    for g in progress(picks, len(picks), "samples"):
        while k + 1 < len(good) and starts[k + 1] <= g:
            k += 1
        rec, view = good[k]
        i = g - starts[k]
        where = f"{SHARDS_DIR}/{rec.shard}[{i}]"
        try:
            sample = view.sample(i)
        except CorruptShardError as e:     # an fp8 scale that is not finite and > 0
            report.findings.append(Finding("error", "bad_scale", where, str(e)))
            continue
        if view.lengths[i] == 0:
            report.findings.append(Finding("error", "empty_sample", where, "sample has 0 tokens"))
        for p in sample_problems(schema, sample):
            report.findings.append(Finding("error", p.kind, where, p.message))
    report.samples_checked = len(picks)
    steps = [(r.min_step, r.max_step) for r in records]
    versions = [(r.min_policy_version, r.max_policy_version) for r in records]
    report.summary = {
        "format": f"{STORE_FORMAT} v{meta.format_version}", "schema_hash": meta.schema_hash,
        "target_model_id": schema.target_model_id, "vocab_size": schema.vocab_size,
        "hidden_size": schema.hidden_size, "layout": schema.layout.to_dict(),
        "fields": [{**f.to_dict(), "encoding": f.encoding, "stored_row_bytes": f.stored_row_nbytes}
                   for f in schema.fields], "producer": meta.producer, "created_at": meta.created_at,
        "samples": sum(r.num_samples for r in records), "tokens": sum(r.num_tokens for r in records),
        "bytes": sum(r.nbytes for r in records), "shards": len(records),
        "writers": len({r.writer_id for r in records}), "ranks": sorted({r.rank for r in records}),
        "step_range": [min(s[0] for s in steps), max(s[1] for s in steps)] if steps else None,
        "policy_version_range": [min(v[0] for v in versions), max(v[1] for v in versions)] if versions else None,
    }
    return report
