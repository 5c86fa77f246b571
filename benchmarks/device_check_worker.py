"""The device check's worker process (scripts/gpu_check.py --worker-units a,b --worker-events FILE):
binds the device, starts a one-rank process group (FSDP2 needs one), builds the synthetic target and
batch when it has a family to step, says it is ready, then runs its units in order and appends each
result to the events file the moment it has it (benchmarks/device_check_runner.py reads it). An
exception inside a unit becomes that unit's "error" row and the next unit still runs.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from benchmarks.device_check_family import run_family
from benchmarks.device_checks import CHECKS
from benchmarks.train_step_common import Data, make_data


def die_with_parent() -> None:
    """On Linux, have the kernel kill this worker when its supervisor dies (SIGKILL included), so an
    orphan never keeps the device busy after the check was stopped from outside."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def emit(path: Path, event: dict[str, Any]) -> None:
    with path.open("a") as f:
        f.write(json.dumps(event) + "\n")
        f.flush()


def run_unit(name: str, args: argparse.Namespace, device: torch.device, data: Data | None) -> dict[str, Any]:
    """A check, or a family's training step on `data`."""
    if name in CHECKS:
        return CHECKS[name].run(args, device)
    assert data is not None
    return run_family(name, args, data, device)


def run_worker(args: argparse.Namespace, names: list[str], events: Path) -> int:
    import torch.distributed as dist

    from verl_speco.train.config import RunSection, TrainerConfig
    from verl_speco.train.distributed import init_distributed

    die_with_parent()
    device, _ = init_distributed(TrainerConfig(run=RunSection(device=args.device)))
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    started = time.perf_counter()
    data = make_data(args, args.context_layers, 1.0) if any(n not in CHECKS for n in names) else None
    emit(events, {"hello": {"device": name, "backend": dist.get_backend(), "world": dist.get_world_size(),
                            "torch": torch.__version__, "data_s": time.perf_counter() - started}})
    for unit in names:
        started = time.perf_counter()
        try:
            row = run_unit(unit, args, device, data)
            row["status"] = "ok" if row["ok"] else "fail"
        except Exception as err:  # the unit's own failure: recorded, the next unit runs
            row = {"ok": False, "status": "error", "error": f"{type(err).__name__}: {err}"[:500],
                   "traceback": traceback.format_exc()[-4000:]}
        emit(events, {"unit": unit, "row": {**row, "wall_s": time.perf_counter() - started}})
    dist.destroy_process_group()
    return 0
