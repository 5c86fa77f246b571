"""FSDP2 over 2 gloo ranks gives every family's draft the 1-rank gradients (float64), and no sharded
module returns a view (issue 21 item 4: FSDP2 warns that an in-place op on a returned view drops the
pre-backward hook and skips the all-gather, i.e. wrong gradients on more than one rank).

Per family (tests/train/fsdp_grads_worker.py): the debug draft of tests/drafters/test_family_contract.py
in float64, loss_chunk_rows 5 (several chunks: FSDP meets the checkpoint recompute of the chunked head),
one `train_step` on a global batch of 4 samples; 2 ranks (2 processes, 2 samples each, `apply_fsdp`
with reshard after forward) and 1 rank (FSDP over a world of 1) equal the plain 1-process step without
FSDP, every parameter's full gradient. The workers run with FSDP2's "returned a view tensor" warning
as an error (checked there on a planted view-returning module). Planted: the last rank's batch altered
(its first sample replaced by rank 0's) moves the gradients far beyond the tolerance."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fsdp_grads_worker as worker  # noqa: E402

pytestmark = pytest.mark.dist
REPO = Path(__file__).resolve().parents[2]
# float64 drafts, but RMSNorm normalises in float32 (drafters/common/layers.py, as HF Llama): a float64
# summation-order difference (another batch size per rank) can flip a float32 ulp there. Observed max
# |2 ranks - 1 rank| / max |1 rank| per parameter: ~1e-15 (EAGLE families, Domino), 1.2e-7 / 1.7e-7
# (DFlash / DSpark); 1 rank vs plain: 0. A lost shard or rank would be O(1); the planted batch: >= 1e-2.
TOL = 1e-5


def _launch(world_size: int, tmp: Path) -> tuple[list[subprocess.Popen[bytes]], list[Path], Path]:
    """The group's ranks, each logging to a file (a full pipe would block a rank the test does not read)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    init, out = tmp / f"pg{world_size}", tmp / f"grads{world_size}.pt"
    logs = [tmp / f"world{world_size}_rank{r}.log" for r in range(world_size)]
    procs = []
    for r, log in enumerate(logs):
        with log.open("wb") as sink:
            procs.append(subprocess.Popen([sys.executable, worker.__file__, str(r), str(world_size), str(init), str(out)],
                                          cwd=REPO, env=env, stdout=sink, stderr=subprocess.STDOUT))
    return procs, logs, out


def _wait(procs: list[subprocess.Popen[bytes]], deadline_s: float) -> None:
    """Until every rank has exited; a rank that failed stops its peers 30 s later (they would wait in
    a collective until the group's timeout), and all are killed at `deadline_s`."""
    start, failed_at = time.monotonic(), None
    while any(p.poll() is None for p in procs):
        now = time.monotonic()
        if failed_at is None and any(p.returncode not in (None, 0) for p in procs):
            failed_at = now
        if now - start > deadline_s or (failed_at is not None and now - failed_at > 30):
            for p in procs:
                if p.poll() is None:
                    p.kill()
        time.sleep(0.2)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[int, dict[str, dict[str, dict[str, torch.Tensor]]]]:
    """{world size: the workers' results}: the 1-rank and the 2-rank group run side by side."""
    tmp = tmp_path_factory.mktemp("fsdp_grads")
    launched = {w: _launch(w, tmp) for w in (1, 2)}
    results = {}
    for w, (procs, logs, out) in launched.items():
        _wait(procs, deadline_s=300)
        report = "\n---\n".join(f"rank {r} exit {p.returncode}:\n{log.read_text(errors='replace')[-5000:]}"
                                 for r, (p, log) in enumerate(zip(procs, logs, strict=True)))
        assert all(p.returncode == 0 for p in procs), f"world {w}:\n{report}"
        results[w] = torch.load(out)
    return results


def _worst(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], what: str) -> float:
    """max over parameters of max |got - want| / max |want| (every gradient is non-zero)."""
    assert got.keys() == want.keys(), what
    assert all(got[n].shape == want[n].shape and got[n].dtype == torch.float64 for n in want), what
    return max(float((got[n] - want[n]).abs().max() / want[n].abs().max()) for n in want)


@pytest.mark.parametrize("name", worker.FAMILIES)
def test_two_ranks_equal_one_rank(name: str, runs: dict[int, dict[str, dict[str, dict[str, torch.Tensor]]]]) -> None:
    torch._C.set_num_threads(1)
    family, model, samples = worker.family_case(name)
    plain = worker.family_step(family, model, samples)  # no process group: no FSDP, one process
    assert all(float(g.abs().sum()) > 0 for g in plain.values()), name
    one = _worst(runs[1][name]["grads"], plain, f"{name}: 1 rank (FSDP) vs plain")
    two = _worst(runs[2][name]["grads"], runs[1][name]["grads"], f"{name}: 2 ranks vs 1 rank")
    planted = _worst(runs[2][name]["planted"], runs[1][name]["grads"], f"{name}: planted")
    print(f"{name}: relative max |1 rank - plain| {one:.1e}, |2 ranks - 1 rank| {two:.1e}, planted {planted:.1e}")
    assert one <= TOL and two <= TOL, (name, one, two)
    assert planted > 100 * TOL, (name, planted)  # the last rank's batch altered: caught
