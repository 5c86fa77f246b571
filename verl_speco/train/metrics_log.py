"""Rank-0 metric sinks: JSONL (one record per logged step), TensorBoard, a tqdm progress bar.

JSONL records: {"step": N, "kind": "train"|"eval", <metric>: float, ...}. On resume from step K
the file is rewritten to drop records with step > K, so it reads as one uninterrupted run. Only
the last line may be torn (a kill, power loss or a full disk mid-write: a cut record, or a tail of
zero bytes): it is dropped with a warning; any other unreadable line is an error naming file:line."""

from __future__ import annotations

import json
import math
import os
import warnings
from pathlib import Path
from typing import Any


def is_timing_metric(key: str) -> bool:
    """Wall-clock figures of a train record (they differ run to run, unlike every other metric):
    tokens_per_s, step_time_s and the stage times time_<stage>_s."""
    return key in ("tokens_per_s", "step_time_s") or (key.startswith("time_") and key.endswith("_s"))


def _parse(path: Path) -> list[tuple[dict[str, Any], bytes]]:
    """(record, its line) for every record of `path`; a torn last line is dropped (warning), any
    other bad line raises."""
    lines = path.read_bytes().split(b"\n")
    records: list[tuple[dict[str, Any], bytes]] = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except ValueError as err:  # JSONDecodeError, UnicodeDecodeError
            if lineno == len(lines):  # after the last newline: a write that did not finish
                warnings.warn(f"{path}:{lineno}: dropping a torn last line ({len(line)} bytes, {err}); "
                              "the run was cut off while writing it", UserWarning, stacklevel=3)
                break
            raise ValueError(f"{path}:{lineno}: not a JSON record ({err}); only the last line of a metrics "
                             "log may be torn: repair or move the file") from err
        if not isinstance(record, dict) or not isinstance(record.get("step"), int):
            raise ValueError(f"{path}:{lineno}: {line[:80]!r}: expected a JSON object with an integer 'step'")
        records.append((record, line))
    return records


def truncate_jsonl(path: Path, last_step: int) -> None:
    """Keep only records with step <= last_step (a resumed run rewrites what follows)."""
    if not path.is_file():
        return
    kept = [line for record, line in _parse(path) if record["step"] <= last_step]
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        f.write(b"".join(line + b"\n" for line in kept))
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)


def read_jsonl(path: str | Path, kind: str | None = "train") -> list[dict[str, Any]]:
    return [r for r, _ in _parse(Path(path)) if kind is None or r.get("kind") == kind]


class MetricsLogger:
    """Every rank may construct it; only `enabled` (rank 0) writes anything."""

    def __init__(self, out_dir: Path, enabled: bool, start_step: int, total_steps: int,
                 tensorboard: bool = True, progress_bar: bool = True) -> None:
        self.enabled = enabled
        self.path = out_dir / "metrics.jsonl"
        self._tb: Any = None
        self._bar: Any = None
        if not enabled:
            return
        out_dir.mkdir(parents=True, exist_ok=True)
        truncate_jsonl(self.path, start_step)
        self._file = self.path.open("a")
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(str(out_dir / "tensorboard"), purge_step=start_step + 1)
        if progress_bar:
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, initial=start_step, desc="draft-train", dynamic_ncols=True)

    def log(self, step: int, kind: str, metrics: dict[str, float]) -> None:
        if not self.enabled:
            return
        record = {"step": step, "kind": kind, **{k: _jsonable(v) for k, v in metrics.items()}}
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        if self._tb is not None:
            for key, value in metrics.items():
                if isinstance(value, (int, float)) and math.isfinite(value):
                    self._tb.add_scalar(f"{kind}/{key}", value, step)
        if self._bar is not None and kind == "train":
            self._bar.set_postfix(loss=f"{metrics.get('loss', float('nan')):.4f}",
                                  lr=f"{metrics.get('lr', 0.0):.2e}", refresh=False)
        if self._bar is not None and kind == "eval":
            self._bar.write(f"step {step} eval: " + ", ".join(f"{k}={v:.4g}" for k, v in metrics.items()))

    def advance(self, n: int = 1) -> None:
        if self._bar is not None:
            self._bar.update(n)

    def close(self) -> None:
        if not self.enabled:
            return
        self._file.close()
        if self._tb is not None:
            self._tb.close()
        if self._bar is not None:
            self._bar.close()


def _jsonable(value: Any) -> Any:
    """floats stay floats (NaN/inf written as strings JSON can hold); ints stay ints."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value
