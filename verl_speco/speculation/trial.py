"""The quickstart's speculation trial: calibrate on the served prompts, plan, and decode one rollout-shaped
batch with plain decoding and with the plan side by side (report["speculation"])."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from verl_speco.speculation.calibrate import calibrate
from verl_speco.speculation.cost_model import fixed_k, k_of_schedule, long_tail_lengths, simulate
from verl_speco.speculation.measure import run_arm
from verl_speco.speculation.plan import plan

TRIAL_PASSES = 2


def trial_batch_sizes(requests: int) -> list[int]:
    """Powers of two up to the number of requests, and that number: 16 -> [1, 2, 4, 8, 16]."""
    sizes = [1 << i for i in range(requests.bit_length()) if 1 << i <= requests]
    return sizes if sizes[-1] == requests else [*sizes, requests]


def trial_ticks(requests: int, k: int) -> int:
    """Progress ticks of `schedule_trial`: each engine's calibration points, then two decodes."""
    return (k + 2) * len(trial_batch_sizes(requests)) * TRIAL_PASSES + 2


def schedule_trial(target: Path, draft: Path, spec: dict[str, Any], prompts: Sequence[Sequence[int]], k: int,
                   max_new_tokens: int, tick: Callable[[], None] | None = None) -> dict[str, Any]:
    """Calibrate, plan, then decode every prompt at once with a GRPO-like spread of lengths, plain and with
    the plan's engine."""
    from verl_speco.engines.vllm_engine import context_length

    sizes = trial_batch_sizes(len(prompts))
    calibration = calibrate(target, draft, spec, prompts, k, sizes, steps=6, warmup=2, passes=TRIAL_PASSES,
                            tick=tick)
    lengths = long_tail_lengths(len(prompts), max(1, max_new_tokens // 2), 0.9, max_new_tokens)
    speculation = plan(calibration, workload=lengths)
    work = {"rollout": [(list(p), n) for p, n in zip(prompts, lengths)]}
    max_len = context_length(max(len(p) for p in prompts), max_new_tokens, k)
    plain = run_arm(target, None, work, 1, len(prompts), max_len, tick=tick)["rollout"]
    if speculation.speculate:
        scheduled = {**spec, "num_speculative_tokens": speculation.k_max, **speculation.vllm_fields()}
        sched = run_arm(target, scheduled, work, 1, len(prompts), max_len, tick=tick)["rollout"]
    else:
        sched = plain
        if tick is not None:
            tick()
    times, rates = calibration.step_times, calibration.per_position
    k_of = k_of_schedule(speculation.schedule) if speculation.speculate else fixed_k(None)
    predicted = {"plain": simulate(times, rates, lengths, fixed_k(None), len(prompts)),
                 "schedule": simulate(times, rates, lengths, k_of, len(prompts))}
    return {"schedule": [list(r) for r in speculation.schedule], "speculate": speculation.speculate,
            "describe": speculation.describe(), "per_position": list(rates), "lengths": lengths,
            "measured_s": {"plain": plain["wall_s"][0], "schedule": sched["wall_s"][0]},
            "predicted_s": predicted, "lossless": sched["outputs"] == plain["outputs"],
            "calibration": calibration.to_dict()}
