#!/usr/bin/env python
"""Held-out learning curves of several standalone training runs, side by side: one PNG and a table.

Each `--run LABEL=PATH` names a run's `metrics.jsonl` (written by `verl-speco-draft-train` into its
`run.out_dir`, and kept by `scripts/bench_family_acceptance.py` under `<out>/train/<family>/`). Only the
held-out records (`"kind": "eval"`, logged every `run.eval_every` steps) are read: one panel per
`--metrics` entry, x = optimizer step. The table printed gives, per run, the last held-out record and
the best value of the first metric.

    python scripts/plot_train_curves.py --run "lr 1e-3=runs/a/metrics.jsonl" \
        --run "lr 3e-3=runs/b/metrics.jsonl" --out runs/curves.png

The label is everything before the last `=`, so a label may itself hold one (`lr=3e-3=path`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from verl_speco.train.metrics_log import read_jsonl  # noqa: E402

METRIC_NAMES = {  # trainer eval metric -> axis label
    "acc_step0": "held-out top-1 accuracy, first draft position",
    "loss": "held-out loss (the family's objective)",
    "ploss": "held-out token loss",
    "vloss": "held-out feature-regression loss",
    "sim_accept_len": "held-out simulated acceptance length",
}


def parse_run(item: str) -> tuple[str, Path]:
    """`LABEL=PATH` -> (label, path); the label is what precedes the last `=`."""
    label, sep, path = item.rpartition("=")
    if not sep or not label.strip() or not path.strip():
        raise SystemExit(f"--run {item!r}: expected LABEL=PATH (a label, '=', a metrics.jsonl path)")
    return label.strip(), Path(path.strip())


def load_curves(runs: list[tuple[str, Path]], metrics: list[str]) -> dict[str, list[dict[str, Any]]]:
    """label -> the run's eval records, ordered by step; every record checked to hold every metric."""
    labels = [label for label, _ in runs]
    if len(set(labels)) != len(labels):
        raise SystemExit(f"--run: labels {labels} repeat one; each run needs its own label")
    curves: dict[str, list[dict[str, Any]]] = {}
    for label, path in runs:
        if not path.is_file():
            raise SystemExit(f"--run {label}={path}: no such file (expected a training run's metrics.jsonl)")
        try:
            records = sorted(read_jsonl(path, kind="eval"), key=lambda r: r["step"])
        except ValueError as err:
            raise SystemExit(str(err)) from None
        if not records:
            raise SystemExit(f"--run {label}={path}: no eval records (train with run.eval_every > 0 and a "
                             "held-out store, data.eval_store or data.eval_fraction)")
        for record in records:
            missing = [m for m in metrics if not isinstance(record.get(m), (int, float))]
            if missing:
                have = sorted(k for k, v in record.items() if isinstance(v, (int, float)) and k != "step")
                raise SystemExit(f"--run {label}={path}: the eval record of step {record['step']} has no "
                                 f"{missing}; it has {have}")
        curves[label] = records
    return curves


def table(curves: dict[str, list[dict[str, Any]]], metrics: list[str]) -> str:
    """Markdown: per run, the last eval step, its metrics, and the best value of the first metric."""
    first = metrics[0]
    pick = min if "loss" in first else max  # a loss is best lowest
    head = ["run", "last eval step", *metrics, f"best {first} (step)"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, records in curves.items():
        last = records[-1]
        best = pick(records, key=lambda r: r[first])
        cells = [label, str(last["step"]), *(f"{last[m]:.4f}" for m in metrics),
                 f"{best[first]:.4f} ({best['step']})"]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def plot(curves: dict[str, list[dict[str, Any]]], metrics: list[str], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(metrics), figsize=(5.2 * len(metrics), 3.8), squeeze=False)
    for ax, metric in zip(axes[0], metrics):
        for label, records in curves.items():
            ax.plot([r["step"] for r in records], [r[metric] for r in records], "-", marker=".", label=label)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(METRIC_NAMES.get(metric, metric))
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(out)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", action="append", required=True, metavar="LABEL=PATH",
                   help="a run's label and metrics.jsonl, repeatable (one line per run)")
    p.add_argument("--metrics", default="acc_step0,loss",
                   help="comma-separated eval metrics, one panel each (default: %(default)s)")
    p.add_argument("--out", type=Path, required=True, help="the PNG written")
    p.add_argument("--title", default="", help="a title over the panels")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    metrics = [m.strip() for m in args.metrics.split(",") if m.strip()]
    if not metrics:
        raise SystemExit(f"--metrics {args.metrics!r}: expected at least one metric name")
    curves = load_curves([parse_run(item) for item in args.run], metrics)
    plot(curves, metrics, args.out, args.title)
    print(table(curves, metrics))
    print(f"chart: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
