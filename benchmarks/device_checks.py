"""The device check's named checks (scripts/gpu_check.py --checks): what one accelerator can prove
beyond a family's training step. Each runs as its own unit (its own timeout, its own result row)
in the worker process, after the process group is up, on --device (cuda, or cpu for the CI run).

A check is `DeviceCheck(name, what, run)`: `run(args, device)` returns a JSON-able row with "ok"
(bool) and "detail" (one line: what was measured against what was expected); an exception is the
check's "error" row. Register it in `CHECKS`. Checks import only what the bare GPU machine has
(torch, numpy, safetensors, pyyaml, transformers): no vLLM, Ray, verl, omegaconf or tqdm
(tests/scripts/test_gpu_check.py runs every check with those made unimportable).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class DeviceCheck:
    name: str
    what: str  # one line: what the check proves on the device
    run: Callable[[argparse.Namespace, torch.device], dict[str, Any]]


def _all() -> tuple[DeviceCheck, ...]:
    from benchmarks.device_checks_online import capture_wait, online_round

    return (
        DeviceCheck("capture_wait", "the capture's device-to-host copies are in flight when collect returns and "
                    "the rows serialised after its wait are the device's", capture_wait),
        DeviceCheck("online_round", "an online drafter round computes in bf16 over float32 weights and moves "
                    "the target head to the device once per version", online_round),
    )


ALL_CHECKS: tuple[DeviceCheck, ...] = _all()  # in run order
CHECKS: dict[str, DeviceCheck] = {c.name: c for c in ALL_CHECKS}
