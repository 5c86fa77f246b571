"""torchrun with 2 processes (gloo, FSDP2) equals 1 process with the same global batch, and a
2-process run resumes exactly (per-rank reader cursors and RNG)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import overrides, run_cli
from safetensors.torch import load_file

from verl_speco.train.metrics_log import read_jsonl

pytestmark = pytest.mark.dist
STEPS = ("run.total_steps=4", "run.save_every=0", "run.eval_every=2")
# 2 ranks x micro-batch 1 x grad_accum 2 = global batch 4, one backward per micro-batch (prepass)
TWO = ("--nproc-per-node", "2", "data.micro_batch_size=1", "optim.grad_accum=2", "optim.denominators=prepass")


@pytest.fixture(scope="module")
def two_proc(tiny_target: Path, tiny_store: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("two_proc")
    run_cli([*TWO[:2], *overrides(tiny_target, tiny_store, out), *STEPS, *TWO[2:]])
    return out


def test_two_processes_equal_one_process(two_proc: Path, tiny_target: Path, tiny_store: Path, tmp_path: Path) -> None:
    # 1 rank x micro-batch 2 x grad_accum 2 = the same global batch 4, all graphs retained, one backward.
    # The reader hands rank r of W the global positions r, r + W, ...: rank 0 reads [p0], [p2] and
    # rank 1 [p1], [p3]; 1 rank reads [p0, p1], [p2, p3].
    run_cli(["--nproc-per-node", "1", *overrides(tiny_target, tiny_store, tmp_path), *STEPS, "optim.grad_accum=2",
             "optim.denominators=retain"])
    for kind, keys in (("train", ("loss", "grad_norm", "acc_step0", "sim_accept_len", "tokens")),
                       ("eval", ("loss", "acc_step0", "acc_step2", "sim_accept_len"))):
        one, two = read_jsonl(tmp_path / "metrics.jsonl", kind), read_jsonl(two_proc / "metrics.jsonl", kind)
        assert [r["step"] for r in one] == [r["step"] for r in two] and one
        for key in keys:
            a, b = [r[key] for r in one], [r[key] for r in two]
            assert a == pytest.approx(b, rel=1e-5, abs=1e-6), (kind, key, a, b)
        print(f"{kind}: max |loss_1proc - loss_2proc| = {max(abs(x['loss'] - y['loss']) for x, y in zip(one, two)):.3e}")
    w1 = load_file(str(tmp_path / "ckpt/step_4/trainer/model.safetensors"))
    w2 = load_file(str(two_proc / "ckpt/step_4/trainer/model.safetensors"))
    assert w1.keys() == w2.keys()
    diff = max(float((w1[k].double() - w2[k].double()).abs().max()) for k in w1 if w1[k].is_floating_point())
    print(f"max |w_1proc - w_2proc| after 4 steps: {diff:.3e}")
    assert diff < 1e-5
    assert (two_proc / "ckpt/step_4/trainer/reader_rank1.json").is_file()
    assert (two_proc / "ckpt/step_4/trainer/rng_rank1.safetensors").is_file()


def test_two_process_resume_is_exact(two_proc: Path, tiny_target: Path, tiny_store: Path, tmp_path: Path) -> None:
    base = [*TWO[:2], *overrides(tiny_target, tiny_store, tmp_path), *STEPS, *TWO[2:]]
    run_cli([*base, "run.stop_after=3"])
    run_cli([*base, "run.resume=true"])
    for kind in ("train", "eval"):
        want, got = read_jsonl(two_proc / "metrics.jsonl", kind), read_jsonl(tmp_path / "metrics.jsonl", kind)
        assert [(r["step"], r["loss"]) for r in got] == [(r["step"], r["loss"]) for r in want]
    a = load_file(str(two_proc / "ckpt/step_4/trainer/model.safetensors"))
    b = load_file(str(tmp_path / "ckpt/step_4/trainer/model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
