"""Records a benchmark trusts when it runs again: training start / done markers and decode caches.

A record is one JSON file holding `{"key": ..., "result": ...}` (or only a key), written whole or
not at all (a temporary file beside it, then a rename), so a run killed mid-write leaves the previous
record or none, never a torn one.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any


def read_record(path: Path) -> dict[str, Any] | None:
    """The record at `path`, or None where there is none."""
    return json.loads(path.read_text()) if path.is_file() else None


def write_record(path: Path, record: dict[str, Any]) -> None:
    """Write `record` whole or not at all."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, default=str))
    tmp.replace(path)


def stored_result(path: Path, key: Any) -> dict[str, Any] | None:
    """The result of the record at `path` when it was written under `key`; None otherwise."""
    stored = read_record(path)
    if stored is None or stored["key"] != key:
        return None
    result: dict[str, Any] = stored["result"]
    return result


def cached(path: Path, key: Any, compute: Callable[[], dict[str, Any]],
           keep: Callable[[dict[str, Any]], dict[str, Any]] = lambda result: result) -> dict[str, Any]:
    """The stored result when the record at `path` holds `key`; else `keep(compute())`, stored unless it
    has `errors` (a failed engine is tried again by the next run)."""
    found = stored_result(path, key)
    if found is not None:
        return found
    result = keep(compute())
    if not result.get("errors"):
        write_record(path, {"key": key, "result": result})
    return result
