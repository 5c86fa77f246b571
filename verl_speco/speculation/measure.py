"""Measured arms of a speculation comparison (the quickstart's trial, scripts/bench_speculation_schedule.py):
one vLLM engine per arm decoding the same workloads (ignore_eos, greedy: same tokens, outputs equal to
plain decoding's), timed wall-clock."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

Workload = list[tuple[list[int], int]]


def run_arm(target: Path, draft: Path | None, spec: Mapping[str, Any] | None, workloads: Mapping[str, Workload],
            repeats: int, max_num_seqs: int, max_model_len: int,
            tick: Callable[[], None] | None = None) -> dict[str, Any]:
    """{workload: {"wall_s": [per repeat], "tokens": n, "outputs": [...]}} for one engine; `spec` None
    is plain decoding (no drafter), else the full vLLM speculative config (its `model` is `draft`)."""
    from verl_speco.engines import vllm_engine

    if spec is None or draft is None:  # plain decoding, or a proposer without a model (n-gram): config whole
        llm = vllm_engine.build_llm(target, None, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                                    speculative_config=None if spec is None else dict(spec))
    else:
        extra = {k: v for k, v in spec.items() if k not in ("method", "num_speculative_tokens", "model")}
        llm = vllm_engine.build_llm(target, draft, method=str(spec["method"]),
                                    num_speculative_tokens=int(spec["num_speculative_tokens"]),
                                    speculative_extra=extra, max_model_len=max_model_len, max_num_seqs=max_num_seqs)
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
