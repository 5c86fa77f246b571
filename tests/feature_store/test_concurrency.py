"""Many writers on one directory, no lock: separate interpreters writing at the same time, forked
writers racing to create ``store.json`` (same rank twice included), and a schema-drift race."""

from __future__ import annotations

import multiprocessing as mp
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import make_sample, make_schema, read_uids
from test_crash import CHILD, check_store

from feature_store import SchemaDriftError, StoreReader, StoreWriter, load_store
from feature_store.store import list_commits


def test_two_writer_processes_at_the_same_time(tmp_path: Path) -> None:
    root = tmp_path / "store"
    procs = [subprocess.Popen([sys.executable, str(CHILD), str(root), str(rank), str(start), "120", "6", "--wait-go"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
             for rank, start in ((0, 0), (1, 1000))]
    for p in procs:                       # both writers exist (store.json raced) before either writes
        assert p.stdout is not None and p.stdout.readline().strip() == "READY"
    for p in procs:
        assert p.stdin is not None
        p.stdin.write("GO\n")
        p.stdin.flush()
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0] and all(o.strip().endswith("DONE") for o in outs)
    expected = set(range(120)) | set(range(1000, 1120))
    stored = check_store(root, expected)
    assert sorted(stored) == sorted(expected)
    assert {c.rank for c in list_commits(root)} == {0, 1}


def _race_writer(root: str, rank: int, start: int, hidden_dtype: str, barrier: object, q: object) -> None:
    torch._C.set_num_threads(1)
    barrier.wait()  # type: ignore[attr-defined]
    try:
        with StoreWriter(root, make_schema(hidden_dtype), rank=rank, flush_samples=4) as w:
            for uid in range(start, start + 30):
                s = make_sample(uid, schema=make_schema(hidden_dtype))
                w.add(s, step=0)
        q.put((rank, start, "ok", w.writer_id))  # type: ignore[attr-defined]
    except SchemaDriftError as e:
        q.put((rank, start, "drift", str(e)))  # type: ignore[attr-defined]


def _race(root: Path, specs: list[tuple[int, int, str]]) -> list[tuple[int, int, str, str]]:
    ctx = mp.get_context("fork")
    barrier, q = ctx.Barrier(len(specs)), ctx.Queue()
    procs = [ctx.Process(target=_race_writer, args=(str(root), r, s, d, barrier, q)) for r, s, d in specs]
    for p in procs:
        p.start()
    results = [q.get(timeout=120) for _ in procs]
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    return results


@pytest.mark.parametrize("trial", range(3))
def test_writers_racing_on_a_fresh_store(tmp_path: Path, trial: int) -> None:
    specs = [(0, 0, "bfloat16"), (0, 100, "bfloat16"), (1, 200, "bfloat16"), (2, 300, "bfloat16")]
    results = _race(tmp_path / "s", specs)
    assert sorted(r[2] for r in results) == ["ok"] * 4
    assert len({r[3] for r in results}) == 4                       # same rank twice: distinct writer ids
    uids = read_uids(tmp_path / "s")
    assert sorted(uids) == sorted(u for _, s, _ in specs for u in range(s, s + 30))


def test_schema_drift_race_has_one_winner(tmp_path: Path) -> None:
    results = _race(tmp_path / "s", [(0, 0, "bfloat16"), (1, 100, "float16")])
    by = {r[2]: r for r in results}
    assert sorted(by) == ["drift", "ok"], results
    winner_dtype = "bfloat16" if by["ok"][1] == 0 else "float16"
    loser_dtype = "float16" if winner_dtype == "bfloat16" else "bfloat16"
    assert f"field 'aux_hidden' dtype: '{winner_dtype}' vs '{loser_dtype}'" in by["drift"][3]
    assert load_store(tmp_path / "s").schema.hash == make_schema(winner_dtype).hash
    reader = StoreReader(tmp_path / "s", shuffle=False, prefetch=0)
    assert len(reader) == 30
