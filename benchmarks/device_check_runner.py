"""The device check's supervisor: units (a drafter family's training step, a named check) run in a
worker process, each under its own timeout, and every result is written as soon as it is known.

A worker (scripts/gpu_check.py --worker-units ...) appends one JSON line per event to an events file:
`{"hello": {...}}` once it is ready (device bound, process group up, synthetic data built), then
`{"unit": name, "row": {...}}` per finished unit, in order. `supervise` polls that file. A worker not
ready within `startup_s` (or dead before it) leaves every unit "not_run": a new one would fail alike.
A unit whose deadline passes (its timeout counted from the previous event, capped by what is left of
the budget) has its worker's whole process group killed (torch.compile's workers too) and is recorded
as "timeout"; a worker that exits inside a unit records it as "crashed" (a CUDA fault poisons its
process, not the next unit's). A fresh worker then takes the units left; a unit with no budget left
is "not_run". `Report` rewrites the JSON report after every row (temporary file + os.replace), so a
run killed from outside keeps what finished.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

STATUSES = ("ok", "fail", "error", "timeout", "crashed", "not_run")  # a row's "status"; only "ok" passes


@dataclass(frozen=True)
class Unit:
    name: str
    kind: str  # "family" (a training step, benchmarks/device_check_family.py) or "check" (benchmarks/device_checks.py)
    timeout_s: float


# (names of the units to run, in order; the events file) -> the started worker, in a session of its own
Spawn = Callable[[list[str], Path], "subprocess.Popen[bytes]"]


def write_atomic(path: Path, text: str) -> None:
    """Write `text` to `path` so that a reader sees the old file or the new one, never a partial one."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


@dataclass
class Report:
    """The run's rows and header; `add` prints a one-line summary and rewrites `path` (None: print only)."""

    path: Path | None
    budget_s: float
    header: dict[str, Any] = field(default_factory=dict)
    rows: list[dict[str, Any]] = field(default_factory=list)
    started: float = field(default_factory=time.perf_counter)
    on_row: Callable[[dict[str, Any]], list[dict[str, Any]]] = lambda row: []  # rows derived from a row

    def add(self, row: dict[str, Any]) -> None:
        for r in (row, *self.on_row(row)):
            self.rows.append(r)
            detail = f": {r['error']}" if r.get("error") else ""
            print(f"[gpu_check] {r['unit']} ({r['kind']}): {r['status'].upper()} ({r['wall_s']:.1f} s){detail}",
                  flush=True)
        self.write(complete=False)

    def write(self, complete: bool) -> None:
        if self.path is None:
            return
        body = {**self.header, "budget_s": self.budget_s, "wall_s": time.perf_counter() - self.started,
                "complete": complete, "rows": self.rows}
        write_atomic(self.path, json.dumps(body, indent=1))


def missed_row(unit: Unit, status: str, wall_s: float, error: str) -> dict[str, Any]:
    return {"unit": unit.name, "kind": unit.kind, "status": status, "ok": False, "wall_s": wall_s, "error": error}


def read_events(path: Path, offset: int) -> tuple[list[dict[str, Any]], int]:
    """The complete JSON lines of `path` from byte `offset`, and the offset after them."""
    if not path.exists():
        return [], offset
    with path.open("rb") as f:
        f.seek(offset)
        chunk = f.read()
    end = chunk.rfind(b"\n") + 1
    return [json.loads(line) for line in chunk[:end].splitlines() if line.strip()], offset + end


def stop(proc: subprocess.Popen[bytes]) -> None:
    """Kill the worker's process group (it runs in a session of its own) and reap the worker."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def supervise(units: list[Unit], spawn: Spawn, workdir: Path, report: Report, startup_s: float,
              poll_s: float = 0.1) -> None:
    """Run `units` through workers started by `spawn`, adding one row per unit to `report`."""
    pending = list(units)
    deadline_all = report.started + report.budget_s
    attempt = 0
    while pending:
        if time.perf_counter() >= deadline_all:
            for unit in pending:
                report.add(missed_row(unit, "not_run", 0.0, f"the budget of {report.budget_s:.0f} s was spent"))
            return
        attempt += 1
        events = workdir / f"events_{attempt}.jsonl"
        proc = spawn([u.name for u in pending], events)
        try:
            pending = _follow(proc, pending, events, report, min(deadline_all, time.perf_counter() + startup_s),
                              deadline_all, poll_s)
        finally:
            stop(proc)


def _follow(proc: subprocess.Popen[bytes], pending: list[Unit], events: Path, report: Report,
            ready_by: float, deadline_all: float, poll_s: float) -> list[Unit]:
    """Record the worker's rows until it has done every unit (returns []), until a unit times out or
    the worker dies (that unit recorded; returns the units after it), or until it fails to start
    (every unit recorded; returns [])."""
    offset, since, ready = 0, time.perf_counter(), False
    while pending:
        exited = proc.poll() is not None  # read the events after this, so no row written before exit is lost
        new, offset = read_events(events, offset)
        for event in new:
            if "hello" in event:
                report.header.update(event["hello"])
                ready, since = True, time.perf_counter()
                continue
            unit = pending.pop(0)
            if event["unit"] != unit.name:
                raise RuntimeError(f"worker answered unit {event['unit']!r}, expected {unit.name!r}")
            report.add({**event["row"], "unit": unit.name, "kind": unit.kind})
            since = time.perf_counter()
        if not pending:
            return []
        now, unit = time.perf_counter(), pending[0]
        if not ready and (exited or now >= ready_by):
            why = f"exited with status {proc.returncode}" if exited else f"was not ready after {now - since:.1f} s"
            for left in pending:
                report.add(missed_row(left, "not_run", 0.0, f"the worker {why} (before its first unit)"))
            return []
        if exited:
            report.add(missed_row(unit, "crashed", now - since, f"the worker exited with status {proc.returncode}"))
            return pending[1:]
        if ready and now >= min(since + unit.timeout_s, deadline_all):
            stop(proc)
            limit = min(unit.timeout_s, deadline_all - since)
            report.add(missed_row(unit, "timeout", now - since, f"stopped after {limit:.1f} s"))
            return pending[1:]
        time.sleep(poll_s)
    return []
