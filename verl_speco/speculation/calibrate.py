"""Measure a `StepTimes` on this machine's vLLM: the decode step of the target alone and with its drafter
at every k = 0..k_max (an engine of k_max whose schedule gives k everywhere) over a grid of batch sizes
(`vllm_engine.time_decode_steps`), plus the draft's acceptance per position. Needs an otherwise idle machine."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from verl_speco.speculation.cost_model import StepTimes
from verl_speco.speculation.plan import Calibration

DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32)


def calibrate(target_dir: str | Path, draft_dir: str | Path | None, spec: dict[str, Any], prompts: Sequence[Sequence[int]],
              k_max: int, batch_sizes: Sequence[int] = DEFAULT_BATCH_SIZES, steps: int = 8, warmup: int = 3,
              passes: int = 2,
              acceptance_prompts: Sequence[Sequence[int]] | None = None, acceptance_tokens: int = 64,
              tick: Callable[[], None] | None = None, **engine_options: Any) -> Calibration:
    """Step times of the target alone and with the draft at k = 0..k_max (`draft_dir` None for a model-free
    proposer), and the acceptance per position at k_max; each point the smallest of `passes` medians."""
    from verl_speco.engines import vllm_engine

    if k_max < 1:
        raise ValueError(f"k_max: got {k_max}, expected >= 1")
    batch_sizes = sorted(set(int(b) for b in batch_sizes))
    max_num_seqs = int(engine_options.pop("max_num_seqs", max(batch_sizes)))
    max_tokens = (warmup + steps + 2) * (k_max + 1) + 1
    context = vllm_engine.context_length(max(len(p) for p in prompts), max(max_tokens, acceptance_tokens), k_max)

    def engine(k: int | None) -> Any:
        """Plain (None), or the draft pinned at k by a one-range schedule under num_speculative_tokens = k_max."""
        pinned = None if k is None else {**spec, "num_speculative_tokens": k_max,
                                         "num_speculative_tokens_per_batch_size": [(1, max_num_seqs, k)]}
        return vllm_engine.build_llm_for_spec(target_dir, pinned, max_model_len=context, max_num_seqs=max_num_seqs,
                                              **engine_options)

    measured: dict[int | None, tuple[list[float], list[float]]] = {}
    rates: list[float] = []
    for k in [None, *range(k_max + 1)]:
        llm = engine(k)
        try:
            best: dict[int, tuple[float, float]] = {}
            for sweep in range(passes):  # ascending, then descending batch sizes: min over the sweeps
                for batch in batch_sizes if sweep % 2 == 0 else batch_sizes[::-1]:
                    before = vllm_engine.snapshot_spec_counters(llm)
                    prefill, step = vllm_engine.time_decode_steps(llm, prompts, batch, steps, warmup, max_tokens)
                    _require_drafts_of(k, vllm_engine.snapshot_spec_counters(llm) - before, batch,
                                       exact=draft_dir is not None)
                    have = best.get(batch, (prefill, step))
                    best[batch] = (min(have[0], prefill), min(have[1], step))
                    if tick is not None:
                        tick()
            measured[k] = ([best[b][0] for b in batch_sizes], [best[b][1] for b in batch_sizes])
            if k == k_max:
                _, summary = vllm_engine.generate_with_metrics(
                    llm, list(acceptance_prompts or prompts), acceptance_tokens, ignore_eos=False)
                rates = [float(r) for r in summary["per_position_acceptance_rate"]]
        finally:
            vllm_engine.shutdown(llm)
    times = StepTimes(tuple(batch_sizes), tuple(measured[None][1]),
                      tuple(tuple(measured[k][1]) for k in range(k_max + 1)),
                      tuple(measured[None][0]), tuple(measured[0][0]))
    info = {"target": str(target_dir), "draft": str(draft_dir), "method": spec["method"], "k_max": k_max,
            "steps": steps, "warmup": warmup, "prompt_tokens": [len(p) for p in prompts][:max(batch_sizes)]}
    return Calibration(times, tuple(rates), max_num_seqs, info)


def _require_drafts_of(k: int | None, counters: Any, batch: int, exact: bool = True) -> None:
    """Refuse a calibration whose engine drafted other than k tokens per round (a model-free proposer may
    draft fewer)."""
    drafted = counters.num_draft_tokens
    rounds = counters.num_drafts
    if not k:
        wrong = drafted > 0
    else:
        wrong = (rounds == 0 or drafted != k * rounds) if exact else drafted > k * rounds
    if wrong:
        raise RuntimeError(f"calibration at k={k}, batch {batch}: the engine drafted {drafted} tokens in {rounds} "
                           f"rounds, expected {0 if not k else k} per round (the batch-size schedule was not applied)")
