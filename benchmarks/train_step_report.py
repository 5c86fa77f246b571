"""The training-step benchmark's measurements and report (scripts/bench_train_step.py): one side's
step times, losses and peak memory, a family's result against the goals, the per-family report and
the summary table (tests/test_scripts_and_clis.py parses its columns)."""

from __future__ import annotations

import argparse
import math
import statistics
from dataclasses import dataclass, field

from benchmarks import train_step_shapes as shapes

GOAL, LIMIT = 0.7, 1.0  # ratio = our median step time / speculators': goal and limit (the issues' targets)


@dataclass
class SideStats:
    """One side's measurements (what a child process sends back as json)."""

    name: str
    trainable: int
    times: dict[str, list[float]] = field(
        default_factory=lambda: {"fwd": [], "bwd": [], "opt": [], "step": [], "cpu": []})
    losses: list[float] = field(default_factory=list)
    peak_mb: float | None = None  # peak RSS over the step minus the resident set before it
    process_peak_mb: float | None = None  # the process's peak RSS during that step (weights included)

    def median_ms(self, key: str) -> float:
        return statistics.median(self.times[key]) * 1e3


@dataclass
class Result:
    family: str
    ours: SideStats
    theirs: SideStats
    check_ok: bool | None  # None: the loss check did not run (--no-check)
    check_losses: tuple[float, float]
    interleaved: bool = True

    @property
    def ratio(self) -> float:
        return self.ours.median_ms("step") / self.theirs.median_ms("step")

    @property
    def mem_ratio(self) -> float | None:
        a, b = self.ours.peak_mb, self.theirs.peak_mb
        return a / b if a is not None and b is not None and b > 0 else None

    @property
    def finite(self) -> bool:
        return all(math.isfinite(x) for s in (self.ours, self.theirs) for x in s.losses) and \
            (self.check_ok is None or all(math.isfinite(x) for x in self.check_losses))


def verdict(ratio: float) -> str:
    return "GOAL" if ratio <= GOAL else ("PASS" if ratio <= LIMIT else "FAIL")


def mem_verdict(r: Result) -> str:
    goal = shapes.MEMORY_GOALS.get(r.family)
    return "n/a" if r.mem_ratio is None or goal is None else ("PASS" if r.mem_ratio <= goal else "FAIL")


def report_family(r: Result, loss_names: tuple[str, str], args: argparse.Namespace) -> None:
    ours, theirs = r.ours, r.theirs
    print(f"\n{'':<28}{'ours':>14}{'speculators':>14}{'ours/spec':>11}"
          + ("" if r.interleaved else "   (each side in its own process: not interleaved)"))
    for key, label in (("step", "step median (ms)"), ("fwd", "  forward+loss (ms)"),
                       ("bwd", "  backward+clip (ms)"), ("opt", "  AdamW step (ms)"),
                       ("cpu", "step CPU time (ms)")):
        a, b = ours.median_ms(key), theirs.median_ms(key)
        print(f"{label:<28}{a:>14.1f}{b:>14.1f}{a / b:>11.2f}")
    for label, fn in (("step min (ms)", lambda s: min(s.times["step"]) * 1e3),
                      ("step max (ms)", lambda s: max(s.times["step"]) * 1e3)):
        print(f"{label:<28}{fn(ours):>14.1f}{fn(theirs):>14.1f}")
    print(f"{'trainable params':<28}{ours.trainable:>14,}{theirs.trainable:>14,}"
          f"{'   (equal)' if ours.trainable == theirs.trainable else '   (DIFFERENT)'}")
    if not args.no_memory:
        for label, key in (("peak RSS over step (MB)", "peak_mb"), ("  process peak RSS (MB)", "process_peak_mb")):
            a, b = getattr(ours, key), getattr(theirs, key)
            ratio = f"{a / b:>11.2f}" if a is not None and b else ""
            print(f"{label:<28}{fmt_mb(a):>14}{fmt_mb(b):>14}{ratio}")
    if r.check_ok is not None:
        print(f"{'loss on the check batch':<28}{r.check_losses[0]:>14.4f}{r.check_losses[1]:>14.4f}"
              f"   (ours = {loss_names[0]}, speculators = {loss_names[1]})")
    print(f"{'loss first timed step':<28}{ours.losses[0]:>14.4f}{theirs.losses[0]:>14.4f}")
    print(f"{'loss last timed step':<28}{ours.losses[-1]:>14.4f}{theirs.losses[-1]:>14.4f}")
    print(f"ratio ours/speculators = {r.ratio:.2f} (goal <= {GOAL}, must be <= {LIMIT}): {verdict(r.ratio)}")


def fmt_mb(mb: float | None) -> str:
    return "n/a" if mb is None else f"{mb:.0f}"


def report_table(results: list[Result], alone: dict[str, SideStats]) -> None:
    """One row per family; columns are space-separated (tests/test_scripts_and_clis.py parses them)."""
    print(f"\nsummary (ratio = median step ours / speculators; PASS <= {LIMIT}, GOAL <= {GOAL}; mem_ratio = peak "
          "RSS over a step ours / speculators, against mem_goal)")
    print(f"{'family':<8}{'ours_ms':>10}{'spec_ms':>10}{'ratio':>7}{'cpu_ratio':>10}{'ours_MB':>9}{'spec_MB':>9}"
          f"{'mem_ratio':>10}{'mem_goal':>9}{'ours_params':>13}{'spec_params':>13}{'ours_loss':>11}{'spec_loss':>11}"
          f"{'check':>7}  verdict  mem_verdict")
    for r in results:
        cpu = r.ours.median_ms("cpu") / r.theirs.median_ms("cpu")
        mem = "n/a" if r.mem_ratio is None else f"{r.mem_ratio:.2f}"
        goal = shapes.MEMORY_GOALS.get(r.family)
        check = "skip" if r.check_ok is None else ("OK" if r.check_ok else "FAIL")
        print(f"{r.family:<8}{r.ours.median_ms('step'):>10.1f}{r.theirs.median_ms('step'):>10.1f}{r.ratio:>7.2f}"
              f"{cpu:>10.2f}{fmt_mb(r.ours.peak_mb):>9}{fmt_mb(r.theirs.peak_mb):>9}{mem:>10}"
              f"{'n/a' if goal is None else f'<={goal}':>9}{r.ours.trainable:>13}{r.theirs.trainable:>13}"
              f"{r.check_losses[0]:>11.4f}{r.check_losses[1]:>11.4f}{check:>7}  {verdict(r.ratio):<7}  "
              f"{mem_verdict(r)}")
    for name, stats in alone.items():
        print(f"ours alone at the recipe's full length ({name}): peak RSS over a step {fmt_mb(stats.peak_mb)} MB, "
              f"process peak {fmt_mb(stats.process_peak_mb)} MB, {stats.trainable:,} trainable params")
