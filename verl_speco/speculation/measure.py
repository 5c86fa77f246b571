"""Measured arms of a speculation comparison (the quickstart's trial, scripts/bench_speculation_schedule.py):
one vLLM engine per arm decoding the same workloads (ignore_eos, greedy: same tokens, outputs equal to
plain decoding's), timed wall-clock."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

Workload = list[tuple[list[int], int]]


def run_arm(target: Path, spec: Mapping[str, Any] | None, workloads: Mapping[str, Workload],
            repeats: int, max_num_seqs: int, max_model_len: int,
            tick: Callable[[], None] | None = None) -> dict[str, Any]:
    """{workload: {"wall_s": [per repeat], "tokens": n, "outputs": [...]}} for one engine; `spec` None
    is plain decoding (no drafter), else the whole vLLM speculative config
    (`vllm_engine.build_llm_for_spec`)."""
    from verl_speco.engines import vllm_engine

    llm = vllm_engine.build_llm_for_spec(target, spec, max_model_len=max_model_len, max_num_seqs=max_num_seqs)
    out: dict[str, Any] = {}
    try:
        vllm_engine.generate(llm, [workloads[next(iter(workloads))][0][0]], 8)  # warm the engine
        for rep in range(repeats):
            for name, work in workloads.items():
                t0 = time.perf_counter()
                rows = vllm_engine.generate(llm, [p for p, _ in work], [n for _, n in work], ignore_eos=True)
                wall = time.perf_counter() - t0
                entry = out.setdefault(name, {"wall_s": [], "tokens": sum(len(r) for r in rows), "outputs": rows})
                entry["wall_s"].append(wall)
                if rows != entry["outputs"]:
                    raise RuntimeError(f"{name}: repeat {rep} decoded other tokens than repeat 0 (greedy)")
                if tick is not None:
                    tick()
    finally:
        vllm_engine.shutdown(llm)
    return out


def noise(walls: Sequence[float]) -> float:
    """Relative spread of repeated timings: (max - min) / min. An arm's figure is its fastest repeat
    (the least disturbed; the first also pays the process's first kernels of each shape)."""
    return (max(walls) - min(walls)) / min(walls)
