"""Crash safety: writers killed with SIGKILL at random points (syscall boundaries of the commit protocol,
random times, in forked children and in separate interpreters) never leave a visible partial shard, and
every sample whose commit returned is readable afterwards, bit-exact, exactly once."""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch
from conftest import assert_bit_equal, make_sample
from writer_child import run

from feature_store import StoreReader
from feature_store.inspect import main as inspect_main
from feature_store.store import STORE_JSON, list_commits

CHILD = Path(__file__).with_name("writer_child.py")


def _acked(lines: list[str]) -> set[int]:
    out: set[int] = set()
    for line in lines:
        if line.startswith("ACK "):
            lo, hi = map(int, line.split()[1:])
            out.update(range(lo, hi + 1))
    return out


def check_store(root: Path, acked: set[int]) -> list[int]:
    """The invariants after a crash: readable, checksums and values valid, acked ⊆ stored, no duplicates."""
    if not (root / STORE_JSON).exists() or not list_commits(root):
        assert not acked, "samples were acknowledged but nothing is committed"
        return []
    reader = StoreReader(root, shuffle=False, prefetch=0, verify_checksums=True, check_values=True)
    it = reader.iter_samples()
    uids = []
    for _ in range(len(reader)):
        sample = next(it)
        uid = int(sample["uid"])
        assert_bit_equal({k: v for k, v in sample.items() if k not in ("global_step", "policy_version")},
                         make_sample(uid))
        uids.append(uid)
    reader.close()
    assert len(uids) == len(set(uids)), "a sample is visible twice"
    missing = acked - set(uids)
    assert not missing, f"acknowledged samples lost: {sorted(missing)[:10]}"
    assert inspect_main([str(root), "--verify-checksums", "--max-samples", "0"]) == 0
    return uids


def _forked_child(root: str, start: int, kill_call: int | None, kill_time: float | None, wfd: int) -> None:
    torch._C.set_num_threads(1)
    if kill_time is not None:
        threading.Timer(kill_time, os.kill, (os.getpid(), signal.SIGKILL)).start()
    if kill_call is not None:           # die right before the k-th fsync/link/unlink of the commit protocol
        calls = [0]
        for name in ("fsync", "link", "unlink"):
            real = getattr(os, name)

            def wrapped(*a: object, _real: object = real, **kw: object) -> object:
                calls[0] += 1
                if calls[0] == kill_call:
                    os.kill(os.getpid(), signal.SIGKILL)
                return _real(*a, **kw)  # type: ignore[operator]
            setattr(os, name, wrapped)
    run(root, 0, start, 400, 5, lambda line: os.write(wfd, (line + "\n").encode()))
    os._exit(0)


def _forked_trial(root: Path, start: int, kill_call: int | None, kill_time: float | None) -> tuple[set[int], int]:
    rfd, wfd = os.pipe()
    proc = mp.get_context("fork").Process(target=_forked_child, args=(str(root), start, kill_call, kill_time, wfd))
    proc.start()
    os.close(wfd)
    chunks = []
    while data := os.read(rfd, 65536):
        chunks.append(data)
    os.close(rfd)
    proc.join(60)
    return _acked(b"".join(chunks).decode().splitlines()), proc.exitcode or 0


def test_sigkill_at_commit_protocol_steps_and_random_times_in_process(tmp_path: Path) -> None:
    rng = random.Random(1234)
    # kill points: every fsync/link/unlink of the first commits (2 commits = 2 x 9 calls), then random times
    trials: list[tuple[int | None, float | None]] = [(k, None) for k in range(1, 19)]
    trials += [(None, rng.uniform(0.0, 0.25)) for _ in range(6)]
    killed = 0
    for n, (kill_call, kill_time) in enumerate(trials):
        root = tmp_path / f"t{n}"
        acked, code = _forked_trial(root, 0, kill_call, kill_time)
        killed += code == -signal.SIGKILL
        check_store(root, acked)
    assert killed >= 20, f"only {killed} of {len(trials)} trials were killed mid-run"


def test_sigkill_at_random_times_subprocess_then_resume(tmp_path: Path) -> None:
    """Separate interpreters writing one store concurrently (ranks 0, 1 and rank 0 twice), killed at random
    times; then a second round of restarted writers (new run ids) on the same store, killed again."""
    rounds = ((0, 1, 0), (0, 2))
    rng = random.Random(99)
    root = tmp_path / "store"
    acked: set[int] = set()
    kills = 0
    for round_, ranks in enumerate(rounds):
        procs = []
        for j, rank in enumerate(ranks):
            start = (round_ * 4 + j) * 100_000
            procs.append(subprocess.Popen([sys.executable, str(CHILD), str(root), str(rank), str(start), "50000", "5"],
                                          stdout=subprocess.PIPE, text=True))
        for proc in procs:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "READY"
        began = time.monotonic()
        for proc, at in sorted(zip(procs, (rng.uniform(0.05, 0.6) for _ in procs)), key=lambda pa: pa[1]):
            time.sleep(max(0.0, began + at - time.monotonic()))
            proc.send_signal(signal.SIGKILL)
        for proc in procs:
            assert proc.stdout is not None
            acked |= _acked(proc.stdout.read().splitlines())
            proc.wait()
            kills += proc.returncode == -signal.SIGKILL
        stored = check_store(root, acked)
        assert len(set(stored) - acked) <= 4 * 5      # at most each writer's commit in flight, unacknowledged
    assert kills == 5, "a writer finished before it was killed"
    writers = {c.writer_id for c in list_commits(root)}
    assert {w[:6] for w in writers} <= {"r00000", "r00001", "r00002"} and len(writers) >= 4
