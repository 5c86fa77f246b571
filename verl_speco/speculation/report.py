"""A plan's predictions as JSON and a PNG: generated tokens/s against batch size for plain decoding,
each fixed k and the schedule, with measured points beside them when a benchmark has them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from verl_speco.speculation.cost_model import PLAIN, k_of_schedule, tokens_per_s
from verl_speco.speculation.plan import Calibration, SpeculationPlan


def predictions(calibration: Calibration, speculation: SpeculationPlan,
                batch_sizes: Sequence[int] | None = None) -> dict[str, dict[int, float]]:
    """{arm: {batch size: predicted tokens/s}} for "plain", "k=<k>" (1..k_max, an engine drafting k
    at every batch size) and "schedule" (plain where the plan does not speculate)."""
    times, rates = calibration.step_times, calibration.per_position
    sizes = list(batch_sizes or range(1, calibration.max_num_seqs + 1))
    k_of = k_of_schedule(speculation.schedule)
    out: dict[str, dict[int, float]] = {"plain": {b: tokens_per_s(times, rates, b, PLAIN) for b in sizes}}
    for k in range(1, min(times.k_max, len(rates)) + 1):
        out[f"k={k}"] = {b: tokens_per_s(times, rates, b, k) for b in sizes}
    out["schedule"] = {b: tokens_per_s(times, rates, b, k_of(b) if speculation.speculate else PLAIN) for b in sizes}
    return out


def plan_report(calibration: Calibration, speculation: SpeculationPlan) -> dict[str, Any]:
    """The JSON a calibration or a re-plan writes: inputs, the schedule and the predictions."""
    return {"calibration": calibration.to_dict(), "schedule": [list(r) for r in speculation.schedule],
            "speculate": speculation.speculate, "num_speculative_tokens": speculation.k_max,
            "describe": speculation.describe(),
            "predicted_tokens_per_s": {arm: {str(b): v for b, v in row.items()}
                                       for arm, row in predictions(calibration, speculation).items()}}


def plot(path: str | Path, predicted: Mapping[str, Mapping[int, float]],
         measured: Mapping[str, Mapping[int, float]] | None = None, title: str = "") -> Path:
    """Tokens/s against batch size (log 2): a line per predicted arm, a marker per measured point."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    colors: dict[str, Any] = {}
    for arm, row in predicted.items():
        sizes = sorted(row)
        style = {"linewidth": 2.5, "color": "black"} if arm == "schedule" else {"linewidth": 1.2}
        (line,) = ax.plot(sizes, [row[b] for b in sizes], label=f"{arm} (predicted)", **style)
        colors[arm] = line.get_color()
    for arm, row in (measured or {}).items():
        sizes = sorted(row)
        ax.plot(sizes, [row[b] for b in sizes], "o", color=colors.get(arm), markersize=5,
                label=f"{arm} (measured)" if arm in ("plain", "schedule") else None)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent requests (batch size)")
    ax.set_ylabel("generated tokens/s")
    ax.set_title(title or "speculation: predicted steady-state tokens/s per batch size", fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
