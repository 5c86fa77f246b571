"""vLLM (CPU) serving the target plainly, with its free n-gram proposer, and with each drafter:
greedy, the same prompts and k, measured one after another in one process (side by side).

Per method: vLLM's acceptance counters, generated tokens per target forward
(`drafters.common.metrics.tokens_per_target_forward`: fair to the n-gram proposer, which drafts
nothing when the context has no match), whether the outputs equal plain decoding (lossless), and the
wall-clock output tokens/s of the `generate` call (engine start excluded; every engine decodes the
same prompts in one batch with the same batch limit).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


def _run(target: Path, prompts: list[list[int]], max_new_tokens: int, eos: int, k: int,
         draft: Path | None = None, spec: dict[str, Any] | None = None, max_num_seqs: int = 16,
         tick: Callable[[], None] | None = None) -> dict[str, Any]:
    from drafters.common.metrics import tokens_per_target_forward
    from drafters.common.tokens import cut_at_end
    from verl_speco.engines import vllm_engine

    # every engine the same context, long enough for the drafter on every step (see context_length)
    longest = vllm_engine.context_length(max(len(p) for p in prompts), max_new_tokens, k)
    whole = None if spec is None else {**spec, "num_speculative_tokens": k, **({"model": str(draft)} if draft else {})}
    llm = vllm_engine.build_llm_for_spec(target, whole, max_model_len=longest, max_num_seqs=max_num_seqs)
    try:
        before = vllm_engine.snapshot_spec_counters(llm)
        t0 = time.perf_counter()
        rows = vllm_engine.generate(llm, prompts, max_new_tokens, ignore_eos=False,
                                    on_done=vllm_engine.per_request(tick))
        wall = time.perf_counter() - t0
        counters = vllm_engine.read_spec_metrics(llm, since=before)
    finally:
        vllm_engine.shutdown(llm)
    generated = sum(len(r) for r in rows)
    return {**counters, "outputs": [cut_at_end(r, (eos,))[0] for r in rows], "generated_tokens": generated,
            "wall_s": round(wall, 3), "output_tokens_per_s": generated / wall,
            "tokens_per_target_forward": tokens_per_target_forward(
                generated, int(counters.get("num_accepted_tokens", 0)), len(rows))}


def side_by_side(target: Path, drafts: dict[str, tuple[Path, dict[str, Any]]], prompts: list[list[int]],
                 eos: int, k: int, max_new_tokens: int, tick: Callable[[], None] | None = None
                 ) -> dict[str, dict[str, Any]]:
    """{"plain": ..., "ngram": ..., family: ...} (see the module docstring). `drafts`: family ->
    (export dir, its vLLM speculative config). A family vLLM fails to serve gets {"error": ...}.
    `tick()` after each prompt each engine answers ((2 + len(drafts)) x len(prompts) of them; an engine
    that fails ticks its remaining prompts at once)."""
    from verl_speco.engines import vllm_engine

    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    plain = _run(target, prompts, max_new_tokens, eos, k, tick=tick)
    results: dict[str, dict[str, Any]] = {"plain": plain}
    methods: dict[str, tuple[Path | None, dict[str, Any]]] = {"ngram": (None, vllm_engine.NGRAM_SPEC), **drafts}
    for name, (draft, spec) in methods.items():
        answered = [0]

        def count(answered: list[int] = answered) -> None:
            answered[0] += 1
            if tick is not None:
                tick()

        try:
            res = _run(target, prompts, max_new_tokens, eos, k, draft, spec, tick=count)
        except Exception as err:  # reported in the table, the other methods still measured
            results[name] = {"error": f"{type(err).__name__}: {err}"[:400]}
            rest = vllm_engine.per_request(tick)
            if rest is not None:  # the bar moves past the prompts the failed engine did not answer
                rest(len(prompts) - answered[0])
            continue
        res["lossless"] = res["outputs"] == plain["outputs"]
        res["speedup_vs_plain"] = res["output_tokens_per_s"] / plain["output_tokens_per_s"]
        results[name] = res
    for res in results.values():
        res.pop("outputs", None)
    return results
