"""A speculation plan from a calibration: the k per batch-size range vLLM 0.32 takes as
`speculative_config.num_speculative_tokens_per_batch_size`, and the calibration file that carries the
measurements from `verl-speco-speculation calibrate` to `drafter.speculation_calibration`."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from verl_speco.speculation.cost_model import (
    PLAIN,
    Schedule,
    StepTimes,
    best_k,
    fixed_k,
    k_of_schedule,
    schedule_ranges,
    simulate,
    tokens_per_s,
)

CALIBRATION_FORMAT = "verl-speco-speculation-calibration"
CALIBRATION_VERSION = 1
# a k > 0 must beat k = 0 by this much at a batch size (and the whole plan beat the engine without a
# drafter by it) before it is chosen: above the 1-2% run-to-run noise of the step times measured here
MIN_GAIN = 0.05


@dataclass(frozen=True)
class Calibration:
    """What a calibration measured: step times, the draft's acceptance per position, and where."""

    step_times: StepTimes
    per_position: tuple[float, ...]  # acceptance rate at draft positions 1..n (vLLM's convention)
    max_num_seqs: int  # the engine's batch limit the schedule covers
    info: dict[str, Any] = field(default_factory=dict)  # target, draft, family, device, engine, prompts

    def with_acceptance(self, per_position: list[float]) -> Calibration:
        """The same step times with another acceptance (a newer draft's held-out figures)."""
        return Calibration(self.step_times, tuple(float(r) for r in per_position), self.max_num_seqs, self.info)

    def to_dict(self) -> dict[str, Any]:
        return {"format": CALIBRATION_FORMAT, "version": CALIBRATION_VERSION, "max_num_seqs": self.max_num_seqs,
                "per_position": list(self.per_position), "step_times": self.step_times.to_dict(), "info": self.info}

    def write(self, path: str | Path) -> Path:
        """Written whole to a temporary name, then renamed: a reader never sees half a file."""
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_name(out.name + ".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=1) + "\n")
        tmp.replace(out)
        return out

    @classmethod
    def read(cls, path: str | Path) -> Calibration:
        """A calibration file; ValueError naming the file, the field and what was expected."""
        try:
            raw = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise ValueError(f"{path}: not a readable calibration file ({err})") from err
        return cls.from_dict(raw, str(path))

    @classmethod
    def from_dict(cls, raw: Any, where: str = "calibration") -> Calibration:
        """What `to_dict` wrote; ValueError naming `where`, the field and what was expected."""
        if not isinstance(raw, dict) or raw.get("format") != CALIBRATION_FORMAT:
            got = raw.get("format") if isinstance(raw, dict) else type(raw).__name__
            raise ValueError(f"{where}: format: got {got!r}, expected {CALIBRATION_FORMAT!r}")
        if raw.get("version") != CALIBRATION_VERSION:
            raise ValueError(f"{where}: version: got {raw.get('version')!r}, expected {CALIBRATION_VERSION}")
        rates = raw.get("per_position")
        if not isinstance(rates, list) or not rates or any(
                not isinstance(r, (int, float)) or not 0 <= r <= 1 for r in rates):
            raise ValueError(f"{where}: per_position: got {rates!r}, expected a non-empty list of rates in [0, 1]")
        seqs = raw.get("max_num_seqs")
        if isinstance(seqs, bool) or not isinstance(seqs, int) or seqs < 1:
            raise ValueError(f"{where}: max_num_seqs: got {seqs!r}, expected an integer >= 1")
        step_times = raw.get("step_times")
        if not isinstance(step_times, dict):
            raise ValueError(f"{where}: step_times: got {step_times!r}, expected a mapping")
        return cls(StepTimes.from_dict(step_times, f"{where}: step_times"), tuple(float(r) for r in rates),
                   seqs, dict(raw.get("info") or {}))


@dataclass(frozen=True)
class SpeculationPlan:
    """The k per batch size (1..max_num_seqs) and whether a drafting engine beats one without a drafter."""

    schedule: Schedule
    speculate: bool  # False: the engine without a drafter is the faster one (k = 0 everywhere, or the workload)
    k_max: int  # the drafting engine's num_speculative_tokens (the largest k of the schedule, >= 1)

    def vllm_fields(self) -> dict[str, Any]:
        """The `speculative_config` fields that apply it in vLLM 0.32 (lists: JSON and OmegaConf safe)."""
        return {"num_speculative_tokens": self.k_max,
                "num_speculative_tokens_per_batch_size": [list(r) for r in self.schedule]}

    def describe(self) -> str:
        """One line: "batch 1-2: k=3, 3-4: k=1, 5-32: k=0"."""
        return ", ".join(f"{a}-{b}: k={k}" if a != b else f"{a}: k={k}" for a, b, k in self.schedule)


def plan(calibration: Calibration, min_gain: float = MIN_GAIN, workload: Sequence[int] | None = None
         ) -> SpeculationPlan:
    """The best k at every batch size 1..max_num_seqs, as vLLM's ranges; with a `workload`, drafting must
    also finish that batch `min_gain` sooner than plain decoding (`cost_model.simulate`), else plain."""
    times, rates = calibration.step_times, calibration.per_position
    if not 0 <= min_gain < 1 or not math.isfinite(min_gain):
        raise ValueError(f"min_gain: got {min_gain}, expected a fraction in [0, 1)")
    ks = [best_k(times, rates, batch, min_gain) for batch in range(1, calibration.max_num_seqs + 1)]
    # the drafting engine pays its draft's KV-keeping forward where k = 0: it must win where it drafts
    # by more than it loses where it does not, or the plan is plain decoding
    speculate = any(k > 0 and tokens_per_s(times, rates, b, k) >= (1 + min_gain) * tokens_per_s(times, rates, b, PLAIN)
                    for b, k in enumerate(ks, start=1))
    if speculate and workload is not None:
        n = calibration.max_num_seqs
        drafting = simulate(times, rates, workload, k_of_schedule(schedule_ranges(ks)), n)
        speculate = drafting * (1 + min_gain) <= simulate(times, rates, workload, fixed_k(PLAIN), n)
    return SpeculationPlan(schedule_ranges(ks), speculate, max(1, *ks))
