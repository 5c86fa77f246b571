"""The quickstart's recipe per target and its time estimate: a `TargetRecipe` holds what the quickstart
does when the user sets nothing (prompts, response cap, training preset, n-gram arm, measured costs; the
`smollm2-135m` run is sized for 2 CPU cores from docs/results/smollm2/README.md). `estimate` gives seconds
per stage; `cpu_has_bf16()` enables bf16 only where the CPU has bf16 units (elsewhere it is emulated, slower)."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from verl_speco.console import Console


BF16_STEP_RATIO = 0.64  # a step in bf16 mixed precision over float32 on AMX (docs/results/smollm2/README.md)


@dataclass(frozen=True)
class TargetRecipe:
    train_prompts: int
    max_new_tokens: int                # collection and serving
    max_length: int | None             # collected sequences cut to this many tokens (None: whole)
    collect_batch_size: int            # target forwards per capture batch (and HF generate's batch)
    preset_suffix: str                 # "" or "_<target>": preset quickstart_<family><suffix> where shipped
    ngram: bool                        # serve vLLM's n-gram proposer too (the baseline to beat)
    # measured costs on the 2-core project machine (the estimate before anything is timed here)
    collect_s_per_prompt: float        # vLLM or HF generation plus the capture pass, per prompt
    step_s: Mapping[str, float]        # a float32 training step per family at its preset ("*": any other)
    fixed_s: float                     # target build, engine starts, export
    evaluate_s_per_prompt: float       # the reference decoder and every vLLM engine, per served prompt
    results: str                       # where longer budgets are measured, and their headline ("": nowhere)


RECIPES: dict[str, TargetRecipe] = {
    # the original quickstart; its costs as measured alone on 2026-12-07 (35 s in all, the target cached)
    "embedded": TargetRecipe(train_prompts=512, max_new_tokens=96, max_length=None, collect_batch_size=128,
                             preset_suffix="", ngram=False, collect_s_per_prompt=0.015, step_s={"*": 0.04},
                             fixed_s=5, evaluate_s_per_prompt=0.6, results=""),
    # 480 prompts x 64 tokens, cut at 640, then the family's quickstart_<family>_smollm2 preset: about 5
    # minutes of steps in bf16 (each family's float32 step at the benchmark's 1,200-step runs,
    # docs/results/smollm2/README.md, x 0.64). Collection, set-up and evaluation as measured by the
    # EAGLE-3 run in docs/real-target.md (0.45 s a prompt, 30 s, 9.3 s a served prompt: 4 engines)
    "smollm2-135m": TargetRecipe(train_prompts=480, max_new_tokens=64, max_length=640, collect_batch_size=16,
                                 preset_suffix="_smollm2", ngram=True, collect_s_per_prompt=0.45,
                                 step_s={"eagle1": 0.906, "eagle2": 0.906, "eagle3": 1.56, "dflash": 1.97,
                                         "peagle": 1.94, "dspark": 3.04, "domino": 3.2, "*": 2.0},
                                 fixed_s=30, evaluate_s_per_prompt=9.3,
                                 results="docs/results/smollm2/README.md (EAGLE-3 at 1,200 steps on 2,000 prompts: "
                                         "1.58 generated tokens per target forward, 1.28x n-gram; the EAGLE-2 tree "
                                         "at 4,800 steps on 8,000 prompts: 2.65)"),
}


def recipe_for(target: str) -> TargetRecipe:
    """The named target's recipe; an HF model directory gets the real-target recipe without its preset
    (its own vocabulary and sizes are unknown here) or its measured costs' meaning."""
    if target in RECIPES:
        return RECIPES[target]
    return dataclasses.replace(RECIPES["smollm2-135m"], preset_suffix="", results="")


def preset_name(family: str, recipe: TargetRecipe, config_dir: Path) -> str:
    """`quickstart_<family><suffix>` when that preset file exists, else `quickstart_<family>`."""
    named = f"quickstart_{family}{recipe.preset_suffix}"
    return named if (config_dir / "preset" / f"{named}.yaml").is_file() else f"quickstart_{family}"


def cpu_has_bf16(cpuinfo: str | Path = "/proc/cpuinfo") -> bool:
    """Whether the CPU computes bf16 natively (flags amx_bf16 or avx512_bf16); False where unknown."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return False
    flags = next((line.split(":", 1)[1].split() for line in text.splitlines() if line.startswith("flags")), [])
    return bool({"amx_bf16", "avx512_bf16"} & set(flags))


def estimate(recipe: TargetRecipe, family: str, train_prompts: int, eval_prompts: int, serve_prompts: int,
             steps: int, bf16: bool = False, step_s: float | None = None) -> dict[str, float]:
    """Seconds per stage: {"setup", "collect", "train", "evaluate", "total"}: the recipe's costs, a
    step x `BF16_STEP_RATIO` with `bf16`; `step_s` replaces the step once the first steps are timed."""
    if step_s is None:
        step_s = recipe.step_s.get(family, recipe.step_s["*"]) * (BF16_STEP_RATIO if bf16 else 1.0)
    parts = {"setup": recipe.fixed_s,
             "collect": recipe.collect_s_per_prompt * (train_prompts + eval_prompts),
             "train": step_s * steps,
             "evaluate": recipe.evaluate_s_per_prompt * serve_prompts}
    return {**parts, "total": sum(parts.values())}


def minutes(seconds: float) -> str:
    return f"{seconds / 60:.0f} min" if seconds >= 90 else f"{seconds:.0f} s"


class StepTimer:
    """A trainer `on_step` callback: after `TIMED_STEPS` steps past the first (which carries the start-up),
    prints the estimate again with the step time measured here (`plan`: `estimate`'s, for the evaluation)."""

    TIMED_STEPS = 5

    def __init__(self, console: Console, t_start: float, plan: dict[str, float]) -> None:
        self.console, self.t_start, self.plan = console, t_start, plan
        self.t0: float | None = None

    def __call__(self, step: int, total: int) -> None:
        if step == 1:
            self.t0 = time.perf_counter()  # the first step carries the start-up; timed from its end
        elif self.t0 is not None and step == 1 + self.TIMED_STEPS:
            step_s = (time.perf_counter() - self.t0) / self.TIMED_STEPS
            left = step_s * (total - step) + self.plan["evaluate"]
            elapsed = time.perf_counter() - self.t_start
            self.console.print(f"estimate: {step_s:.2f} s a training step here: about {minutes(left)} to go, "
                               f"{minutes(elapsed + left)} in all", err=True)
