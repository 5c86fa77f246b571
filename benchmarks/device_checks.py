"""The device check's named checks (scripts/gpu_check.py --checks): what one accelerator can prove
beyond a family's training step. Each runs as its own unit (its own timeout, its own result row)
in the worker process, after the process group is up, on --device (cuda, or cpu for the CI run).

A check is `DeviceCheck(name, what, "module:function", timeout_s)`: the function `(args, device)`
returns a JSON-able row with "ok" (bool) and "detail" (one line: what was measured against what was
expected); an exception, its import's included, is the check's "error" row. Register it in
`ALL_CHECKS`. Checks import only what the bare GPU machine has
(torch, numpy, safetensors, pyyaml, transformers): no vLLM, Ray, verl, omegaconf or tqdm
(tests/scripts/test_gpu_check.py runs every check with those made unimportable).
"""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class DeviceCheck:
    name: str
    what: str  # one line: what the check proves on the device
    target: str  # "module:function", the function (args, device) -> row; imported when the check runs
    timeout_s: float  # the check's default timeout (gpu_check.py --check-timeout-s overrides every one)

    def run(self, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
        module, _, attr = self.target.partition(":")
        fn: Callable[[argparse.Namespace, torch.device], dict[str, Any]] = getattr(importlib.import_module(module), attr)
        return fn(args, device)


ALL_CHECKS: tuple[DeviceCheck, ...] = (  # in run order
    DeviceCheck("capture_wait", "the capture's device-to-host copies are in flight when collect returns and the "
                "rows serialised after its wait are the device's", "benchmarks.device_checks_online:capture_wait", 20),
    DeviceCheck("online_round", "an online drafter round computes in bf16 over float32 weights and moves the "
                "target head to the device once per version", "benchmarks.device_checks_online:online_round", 45),
    DeviceCheck("dflash_rebuild", "the DFlash fused context K/V buffer is rebuilt with each tensor-parallel "
                "rank's own kv heads, in place", "benchmarks.device_checks_kernels:dflash_rebuild", 20),
    DeviceCheck("flex_compiles", "compiled flex attention needs one graph per mask function over TTT steps "
                "and DFlash shapes", "benchmarks.device_checks_kernels:flex_compiles", 60),
    DeviceCheck("speculation_roofline", "this accelerator's achieved bandwidth and matmul FLOP/s, the speculation "
                "cost model's hardware figures (scripts/project_speculation_gpu.py --hardware)",
                "benchmarks.device_checks_speculation:speculation_roofline", 5),
)
CHECKS: dict[str, DeviceCheck] = {c.name: c for c in ALL_CHECKS}
