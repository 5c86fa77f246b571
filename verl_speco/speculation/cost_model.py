"""When speculation pays: measured decode-step times (`StepTimes`, once per hardware, target and draft
shape) and a drafter's acceptance per position -> tokens/s per (batch size, k), the best k per batch-size
range and a rollout's wall-clock. "k = 0 in a drafting engine" still pays the draft's first forward (vLLM
0.32 keeps its KV in sync), so it and "no drafter" are different measured arms."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from drafters.common.metrics import expected_tokens_per_step

Schedule = list[tuple[int, int, int]]  # vLLM 0.32: inclusive (first batch size, last batch size, k)
PLAIN = None  # k_of(batch) returning PLAIN: the engine without a drafter


@dataclass(frozen=True)
class StepTimes:
    """Measured seconds per engine step at each batch size of `batch_sizes` (ascending)."""

    batch_sizes: tuple[int, ...]
    plain_step_s: tuple[float, ...]  # [batch] one decode step, engine without a drafter
    draft_step_s: tuple[tuple[float, ...], ...]  # [k][batch] drafting engine at k = 0..k_max
    plain_prefill_s: tuple[float, ...]  # [batch] submit -> every request has its first token
    draft_prefill_s: tuple[float, ...]  # [batch] the same, drafting engine

    def __post_init__(self) -> None:
        n = len(self.batch_sizes)
        if n == 0 or list(self.batch_sizes) != sorted(set(self.batch_sizes)) or self.batch_sizes[0] < 1:
            raise ValueError(f"batch_sizes: got {self.batch_sizes}, expected ascending distinct integers >= 1")
        rows = {"plain_step_s": [self.plain_step_s], "plain_prefill_s": [self.plain_prefill_s],
                "draft_prefill_s": [self.draft_prefill_s], "draft_step_s": list(self.draft_step_s)}
        if not self.draft_step_s:
            raise ValueError("draft_step_s: got no rows, expected one per k = 0..k_max")
        for name, row_list in rows.items():
            for row in row_list:
                if len(row) != n or any(not (math.isfinite(t) and t > 0) for t in row):
                    raise ValueError(f"{name}: got {row}, expected {n} finite times > 0 (one per batch size)")

    @property
    def k_max(self) -> int:
        return len(self.draft_step_s) - 1

    def step_s(self, batch: int, k: int | None) -> float:
        """Seconds per decode step at `batch` running requests (k None: no drafter), linear between measured
        batch sizes and along the nearest segment outside (never below the smallest measured time)."""
        if k is not None and not 0 <= k <= self.k_max:
            raise ValueError(f"k: got {k}, expected 0..{self.k_max} or None (plain)")
        row = self.plain_step_s if k is None else self.draft_step_s[k]
        return _interpolate(self.batch_sizes, row, batch)

    def prefill_s(self, batch: int, drafting: bool) -> float:
        return _interpolate(self.batch_sizes, self.draft_prefill_s if drafting else self.plain_prefill_s, batch)

    def to_dict(self) -> dict[str, Any]:
        return {"batch_sizes": list(self.batch_sizes), "plain_step_s": list(self.plain_step_s),
                "draft_step_s": [list(r) for r in self.draft_step_s], "plain_prefill_s": list(self.plain_prefill_s),
                "draft_prefill_s": list(self.draft_prefill_s)}

    @classmethod
    def from_dict(cls, raw: dict[str, Any], where: str = "step_times") -> StepTimes:
        keys = ("batch_sizes", "plain_step_s", "draft_step_s", "plain_prefill_s", "draft_prefill_s")
        missing = [k for k in keys if k not in raw]
        if missing:
            raise ValueError(f"{where}: missing {missing}, expected the keys {list(keys)}")
        try:
            return cls(tuple(int(b) for b in raw["batch_sizes"]), tuple(float(t) for t in raw["plain_step_s"]),
                       tuple(tuple(float(t) for t in r) for r in raw["draft_step_s"]),
                       tuple(float(t) for t in raw["plain_prefill_s"]), tuple(float(t) for t in raw["draft_prefill_s"]))
        except (TypeError, ValueError) as err:
            raise ValueError(f"{where}: {err}") from err


def _interpolate(xs: Sequence[int], ys: Sequence[float], x: int) -> float:
    """Piecewise linear through (xs, ys); outside, the first or last segment continued (a single point:
    constant); clamped below at min(ys) so an extrapolation never predicts a free step."""
    if len(xs) == 1:
        return float(ys[0])
    i = 1
    while i < len(xs) - 1 and xs[i] < x:
        i += 1
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return max(min(ys), y0 + (y1 - y0) * (x - x0) / (x1 - x0))


def tokens_per_s(times: StepTimes, per_position: Sequence[float], batch: int, k: int | None) -> float:
    """Steady-state generated tokens/s of `batch` running requests (k None: engine without a drafter)."""
    gained = 1.0 if k is None else expected_tokens_per_step(list(per_position), k)
    return batch * gained / times.step_s(batch, k)


def best_k(times: StepTimes, per_position: Sequence[float], batch: int, min_gain: float) -> int:
    """The k (0..min(k_max, positions measured)) of the highest predicted tokens/s at `batch` in the
    drafting engine; a k > 0 must beat k = 0 by `min_gain` (a fraction), else 0."""
    ks = range(0, min(times.k_max, len(per_position)) + 1)
    rates = {k: tokens_per_s(times, per_position, batch, k) for k in ks}
    k = max(rates, key=lambda key: (rates[key], -key))
    return k if k == 0 or rates[k] >= (1.0 + min_gain) * rates[0] else 0


def schedule_ranges(ks: Sequence[int]) -> Schedule:
    """Dense k per batch size (ks[0] is batch 1) -> vLLM's inclusive ranges: [3, 3, 1, 0, 0] ->
    [(1, 2, 3), (3, 3, 1), (4, 5, 0)]."""
    out: Schedule = []
    for batch, k in enumerate(ks, start=1):
        if out and out[-1][2] == k:
            out[-1] = (out[-1][0], batch, k)
        else:
            out.append((batch, batch, int(k)))
    return out


def k_of_schedule(schedule: Schedule) -> Callable[[int], int]:
    """The k a schedule gives at a batch size (past the last range: its k, as vLLM carries it)."""
    def k_of(batch: int) -> int:
        for first, last, k in schedule:
            if first <= batch <= last:
                return k
        return schedule[-1][2]
    return k_of


def fixed_k(k: int | None) -> Callable[[int], int | None]:
    """The same k at every batch size (None: the engine without a drafter), for `simulate`."""
    def k_of(batch: int) -> int | None:
        return k
    return k_of


def simulate(times: StepTimes, per_position: Sequence[float], lengths: Sequence[int],
             k_of: Callable[[int], int | None], max_num_seqs: int) -> float:
    """Predicted seconds to generate `lengths[i]` tokens per request, all submitted at once (up to
    `max_num_seqs` running, the rest in waves), each step costing `times.step_s(b, k_of(b))`."""
    if not lengths or min(lengths) < 1 or max_num_seqs < 1:
        raise ValueError(f"lengths: expected >= 1 request of >= 1 token (got {len(lengths)} requests, "
                         f"shortest {min(lengths) if lengths else None}); max_num_seqs {max_num_seqs}")
    drafting = any(k_of(b) is not None for b in range(1, max_num_seqs + 1))
    waiting = sorted(lengths, reverse=True)  # pop() admits the shortest first; the order changes the total little
    running: list[float] = []  # tokens still to generate after the first
    rates = list(per_position)
    gains = {k: 1.0 if k is None else expected_tokens_per_step(rates, k) for k in map(k_of, range(1, max_num_seqs + 1))}
    seconds = 0.0
    while waiting or running:
        if waiting and len(running) < max_num_seqs:
            wave = [waiting.pop() for _ in range(min(max_num_seqs - len(running), len(waiting)))]
            seconds += times.prefill_s(len(wave), drafting)
            running += [float(n - 1) for n in wave]
            running = [r for r in running if r > 0]
            continue
        batch = len(running)
        k = k_of(batch)
        gained = gains[k]
        seconds += times.step_s(batch, k)
        running = [r - gained for r in running if r - gained > 1e-9]
    return seconds


def long_tail_lengths(n: int, median: float, sigma: float, cap: int) -> list[int]:
    """`n` response lengths with a GRPO step's right-skewed spread, without randomness: the quantiles
    (i + 0.5) / n of a log-normal of that median and log-space `sigma`, capped at `cap`."""
    from statistics import NormalDist

    if n < 1 or median < 1 or sigma < 0 or cap < 1:
        raise ValueError(f"long_tail_lengths: got n={n}, median={median}, sigma={sigma}, cap={cap}; expected "
                         "n >= 1, median >= 1, sigma >= 0, cap >= 1")
    z = NormalDist()
    return [max(1, min(cap, round(median * math.exp(sigma * z.inv_cdf((i + 0.5) / n))))) for i in range(n)]
