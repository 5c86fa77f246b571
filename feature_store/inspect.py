"""``verl-speco-inspect-features STORE [--max-samples N] [--json] [--strict] [--verify-checksums]``

Prints a summary (samples, tokens, bytes, shards, steps, layout, schema, fields with their storage encoding
and bytes per row), then the problems found
by the per-shard checks (a header whose writer id or seq is not its commit record's included), the
duplicate-content check across shards, the sampled per-sample checks (see report.py) and the uncommitted
leftovers.

Exit status: 0 clean; 1 problems found (with ``--strict``, leftovers/warnings count as problems);
2 the store cannot be used at all (no or invalid ``store.json``) or the arguments are wrong.
A progress bar goes to stderr for large stores (over 64 shards or 1 GiB); ``--json`` prints only the
machine-readable report on stdout."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any, TypeVar

from feature_store.errors import SchemaError, StoreNotFoundError
from feature_store.report import Report, inspect_store

T = TypeVar("T")
LARGE_SHARDS, LARGE_BYTES = 64, 1 << 30


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="verl-speco-inspect-features",
                                description="Summarise and check a Feature Store (exit 0 clean, 1 problems, "
                                            "2 unusable store or bad arguments).")
    p.add_argument("store", help="store root (the directory holding store.json)")
    p.add_argument("--max-samples", type=int, default=256, metavar="N",
                   help="per-sample checks on N samples spread over the store (0 = every sample; default 256)")
    p.add_argument("--json", action="store_true", help="print a machine-readable JSON report instead of text")
    p.add_argument("--strict", action="store_true", help="warnings (uncommitted leftovers) count as problems")
    p.add_argument("--verify-checksums", action="store_true", help="read every shard and check its checksum")
    p.add_argument("--no-progress", action="store_true", help="never show a progress bar")
    return p


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} TiB"


def _print_text(r: Report, strict: bool) -> None:
    s = r.summary
    lay = s["layout"]
    rows = [("format", s["format"]), ("schema hash", s["schema_hash"]),
            ("target model", f"{s['target_model_id'] or '?'} (vocab {s['vocab_size']}, hidden {s['hidden_size']})"),
            ("layout", f"layer_ids={lay['layer_ids']} convention={lay['convention']} "
                       f"last_hidden={lay['last_hidden']} tag={lay['tag']!r}"),
            ("samples", f"{s['samples']}"), ("tokens", f"{s['tokens']}"), ("bytes", _human(s["bytes"])),
            ("shards", f"{s['shards']} committed, {s['writers']} writer run(s), ranks {s['ranks']}"),
            ("steps", "-" if s["step_range"] is None else "{}..{}".format(*s["step_range"])),
            ("policy versions", "-" if s["policy_version_range"] is None else "{}..{}".format(*s["policy_version_range"]))]
    print(f"Feature Store {r.store}")
    for k, v in rows:
        print(f"  {k:<16} {v}")
    print("fields")
    for f in s["fields"]:
        shape = (["T"] if f["per_token"] else []) + f["shape"]
        where = f"per-token ({f['segment']})" if f["per_token"] else "per-sample"
        stored = f"{f['encoding']}, {f['stored_row_bytes']} B/{'token' if f['per_token'] else 'sample'}"
        print(f"  {f['name']:<22} {f['dtype']:<9} {str(shape):<14} {where:<20} {stored:<22} {f['role'] or ''}")
    print(f"checks: {len(r.shards)} commit record(s), checksums "
          f"{'verified' if r.checksums_verified else 'not verified (--verify-checksums)'}, "
          f"{r.samples_checked} sample(s) checked")
    for title, items in (("problems", r.errors), ("warnings", r.warnings)):
        if items:
            print(f"{title} ({len(items)}):")
            for f in items[:50]:
                print(f"  {f.kind:<18} {f.where}: {f.message}")
            if len(items) > 50:
                print(f"  ... {len(items) - 50} more (see --json)")
    bad = len(r.errors) + (len(r.warnings) if strict else 0)
    print("result: " + ("CLEAN" if not bad else f"PROBLEMS FOUND ({len(r.errors)} error(s), "
                                                 f"{len(r.warnings)} warning(s))"))


def _progress_for(root: Path, enabled: bool) -> Any:
    shards = list((root / "shards").glob("*.safetensors")) if (root / "shards").is_dir() else []
    large = len(shards) > LARGE_SHARDS or sum(p.stat().st_size for p in shards) > LARGE_BYTES
    if not (enabled and large):
        return lambda it, total, desc: it
    from tqdm import tqdm

    def bar(it: Iterable[T], total: int, desc: str) -> Iterable[T]:
        return tqdm(it, total=total, desc=desc, file=sys.stderr, unit=desc.rstrip("s"))
    return bar


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:          # argparse: 0 for --help, 2 for bad arguments
        return 0 if e.code in (0, None) else 2
    if args.max_samples < 0:
        print(f"{parser.prog}: error: --max-samples {args.max_samples}: expected >= 0", file=sys.stderr)
        return 2
    root = Path(args.store)
    try:
        if not root.is_dir():
            raise StoreNotFoundError(f"{root}: not a directory")
        report = inspect_store(root, max_samples=args.max_samples, verify_checksums=args.verify_checksums,
                               progress=_progress_for(root, not args.no_progress))
    except (StoreNotFoundError, SchemaError, OSError) as e:
        if args.json:
            print(json.dumps({"store": str(root), "usable": False, "ok": False, "error": str(e)}, indent=1))
        print(f"{parser.prog}: error: unusable store: {e}", file=sys.stderr)
        return 2
    failed = bool(report.errors) or (args.strict and bool(report.warnings))
    if args.json:
        print(json.dumps({"usable": True, "ok": not failed, "strict": args.strict, **report.to_dict()}, indent=1))
    else:
        _print_text(report, args.strict)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
