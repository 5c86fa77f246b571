"""A tiny writer process for the crash and concurrency tests.

    python writer_child.py ROOT RANK UID_START COUNT FLUSH_SAMPLES [--wait-go]

Writes samples ``conftest.make_sample(uid)`` for uid in [UID_START, UID_START + COUNT), prints ``READY``
once its StoreWriter exists (then, with ``--wait-go``, waits for a line on stdin), and after every
commit that returned prints ``ACK <first uid> <last uid>`` (flushed), finally ``DONE``.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from conftest import make_sample, make_schema  # noqa: E402

from feature_store import StoreWriter  # noqa: E402


def run(root: str, rank: int, start: int, count: int, flush: int, emit: object) -> None:
    """Write and report commits through ``emit(line)``; shared with the forked (in-process) children."""
    w = StoreWriter(root, make_schema(), rank=rank, flush_samples=flush, flush_interval_steps=0)
    emit("READY")  # type: ignore[operator]
    if "--wait-go" in sys.argv:
        sys.stdin.readline()
    first = start
    for uid in range(start, start + count):
        rec = w.add(make_sample(uid), step=uid // 10)
        if rec is not None:
            emit(f"ACK {first} {uid}")  # type: ignore[operator]
            first = uid + 1
    if w.flush() is not None:
        emit(f"ACK {first} {start + count - 1}")  # type: ignore[operator]
    w.close()
    emit("DONE")  # type: ignore[operator]


def _print(line: str) -> None:
    print(line, flush=True)


if __name__ == "__main__":
    root, rank, start, count, flush = sys.argv[1], *map(int, sys.argv[2:6])
    run(root, rank, start, count, flush, _print)
