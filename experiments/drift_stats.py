"""Statistics of the drift studies, in one place: the paired per-prompt difference of two drafts
(`experiments.drift`, the embedded harness), the goal window of a paired verl run
(`scripts/drift_real_grpo.py`, `scripts/drift_reachable.py`), the reader of a run's `metrics.jsonl`,
and the interval on how often the goal is met over runs (`scripts/drift_seeds.py`).
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

GOAL_RATIO = 1.3  # co-trained over frozen (the served draft over the initial one, on the same policy)
GOAL_FROM_STEP = 4  # the policy's first update lands at step 1; the goal counts from the third step after it


def paired_difference(base: list[list[int]], other: list[list[int]]) -> dict[str, float]:
    """Per-prompt acceptance lengths of two drafters on the same prompts: `other` minus `base`.

    Each entry is a prompt's `[num_drafts, num_accepted_tokens]`; its acceptance length is
    1 + accepted / drafts (vLLM's convention). Prompts either drafter never drafted for (a reply of
    at most one token) are left out. Returns `prompts` (the number used), the `mean_difference`,
    its `standard_error` (sample standard deviation / sqrt(prompts)) and `t` = mean / standard error.
    """
    if len(base) != len(other):
        raise ValueError(f"paired_difference: {len(base)} vs {len(other)} prompts")
    diffs = [a_other / d_other - a_base / d_base
             for (d_base, a_base), (d_other, a_other) in zip(base, other) if d_base > 0 and d_other > 0]
    if len(diffs) < 2:
        raise ValueError(f"paired_difference: {len(diffs)} prompt(s) with drafts on both sides, expected >= 2")
    mean = statistics.fmean(diffs)
    se = statistics.stdev(diffs) / math.sqrt(len(diffs))
    return {"prompts": len(diffs), "mean_difference": mean, "standard_error": se,
            "t": mean / se if se > 0 else math.copysign(math.inf, mean)}


def goal_window(records: Iterable[Mapping[str, Any]], from_step: int = GOAL_FROM_STEP,
                ratio: float = GOAL_RATIO) -> dict[str, Any]:
    """The drift goal over the validation steps >= `from_step` of one paired arm.

    Each record is one validation step: `step`, `heldout_acceptance` (the served draft, tokens per target
    forward) and `heldout_baseline_acceptance` (the initial draft on the same policy); the gain is served
    over initial. Records without the initial draft's figure are skipped.
    Returns `steps` (the steps counted, in order), the margin (served minus initial) `margin_mean` and
    `margin_sd` (sample sd; 0.0 for one step), `gain_min`, `gain_mean`, `at_or_above` (steps whose gain
    is >= `ratio`) and `met` (every counted step is, and there is at least one).

    Worked example, from_step 4, ratio 1.3: steps 3, 4, 5 with served / initial 2.0 / 2.0, 2.6 / 2.0 and
    2.4 / 2.0 (gains 1.0, 1.3, 1.2) count steps 4 and 5: margins 0.6 and 0.4 (mean 0.5, sd 0.1414),
    gain min 1.2, mean 1.25, 1 step at or above 1.3, not met.
    """
    rows = sorted((r for r in records if "heldout_baseline_acceptance" in r and int(r["step"]) >= from_step),
                  key=lambda r: int(r["step"]))
    if not rows:
        raise ValueError(f"goal_window: no paired validation step >= {from_step}")
    steps = [int(r["step"]) for r in rows]
    if len(set(steps)) != len(steps):
        raise ValueError(f"goal_window: steps {steps} repeat; pass the records of one arm")
    margins = [float(r["heldout_acceptance"]) - float(r["heldout_baseline_acceptance"]) for r in rows]
    gains = [gain for _, gain in paired_gains(rows)]
    above = sum(g >= ratio for g in gains)
    return {"from_step": from_step, "ratio": ratio, "steps": steps,
            "margin_mean": statistics.fmean(margins),
            "margin_sd": statistics.stdev(margins) if len(margins) > 1 else 0.0,
            "gain_min": min(gains), "gain_mean": statistics.fmean(gains),
            "at_or_above": above, "met": above == len(gains)}


def paired_gains(records: Iterable[Mapping[str, Any]]) -> list[tuple[int, float]]:
    """(step, served over initial draft on the same policy) for every record with both figures, by step."""
    return sorted((int(r["step"]), float(r["heldout_acceptance"]) / float(r["heldout_baseline_acceptance"]))
                  for r in records if "heldout_baseline_acceptance" in r)


def reachability(gains: Iterable[tuple[int, float]], reachable_gains: Mapping[int, float],
                 from_step: int = GOAL_FROM_STEP, ratio: float = GOAL_RATIO) -> dict[str, Any]:
    """How far each window step's gain was from what any draft could reach on that step.

    `gains` are (step, served over initial) as `paired_gains` gives them; `reachable_gains` maps a step
    to the gain of a draft that gets every token right but the computed numbers (`scripts/drift_reachable.py`,
    its `reachable_gain`). Window steps without a reachable figure are refused by step. Returns `met` and
    `missed`: (step, gain, reachable gain) of the steps >= `from_step` at or above `ratio`, and below it.

    Worked example, from_step 4, ratio 1.3: gains {3: 1.0, 4: 1.25, 5: 1.4} and reachable {3: 1.9, 4: 1.32,
    5: 1.8}: step 3 is outside the window; met [(5, 1.4, 1.8)], missed [(4, 1.25, 1.32)] (a step where even
    a draft perfect on the text would make only 1.32x).
    """
    met: list[tuple[int, float, float]] = []
    missed: list[tuple[int, float, float]] = []
    for step, gain in gains:
        if step < from_step:
            continue
        if step not in reachable_gains:
            raise ValueError(f"reachability: no reachable gain for step {step}")
        (met if gain >= ratio else missed).append((step, gain, float(reachable_gains[step])))
    return {"met": met, "missed": missed}


def json_line(path: Path, n: int, line: str) -> dict[str, Any]:
    """Line `n` of `path`, one JSON object; anything else is refused with its file:line."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as err:
        raise ValueError(f"{path}:{n}: not a JSON line ({err.msg}); expected one JSON object per line") from None
    if not isinstance(row, dict):
        raise ValueError(f"{path}:{n}: a JSON {type(row).__name__}; expected one JSON object per line")
    return row


def paired_records(path: Path, arm: str = "cotrained") -> list[dict[str, Any]]:
    """The records of `arm` that carry the initial draft's figure (`heldout_baseline_acceptance`), in file
    order, from a drift study's `metrics.jsonl` (`scripts/drift_real_grpo.py --paired`). Blank lines are
    skipped; a line that is not a JSON object is refused with its file:line."""
    records = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            rec = json_line(path, n, line)
            if rec.get("arm") == arm and "heldout_baseline_acceptance" in rec:
                records.append(rec)
    return records


def wilson_interval(successes: int, trials: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval for a rate of `successes` in `trials` (95% at the default z).

    With p = successes / trials and n = trials: centre (p + z^2 / 2n) / (1 + z^2 / n), half-width
    z sqrt(p (1 - p) / n + z^2 / 4n^2) / (1 + z^2 / n). Unlike p +- z sqrt(p (1 - p) / n) it stays inside
    [0, 1] and is not empty at 0 or n successes, which is where a handful of runs lands.

    Worked example: 2 met in 7 runs, z = 1.96: p = 0.2857, z^2 / n = 0.5488, centre 0.5601 / 1.5488 =
    0.3616, half-width 1.96 x sqrt(0.02915 + 0.01960) / 1.5488 = 0.2795: (0.082, 0.641).
    """
    if trials < 1 or not 0 <= successes <= trials:
        raise ValueError(f"wilson_interval: {successes} successes in {trials} trials; expected 0 <= successes "
                         f"<= trials and trials >= 1")
    p, n, z2 = successes / trials, trials, z * z
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return max(0.0, centre - half), min(1.0, centre + half)
