"""The device check's short speculation calibration: this accelerator's achieved memory bandwidth and
dense matmul FLOP/s, which replace the datasheet figures of `verl_speco.speculation.roofline` in
scripts/project_speculation_gpu.py (`--hardware gpu_check.json`). No vLLM on the device machine, so
the engine's own step is not timed here; the roofline's step time of Qwen3-8B from these figures is.
"""

from __future__ import annotations

import argparse
import math
import time
from typing import Any

import torch


def _timed(fn: Any, device: torch.device, repeats: int) -> float:
    """Median seconds of `fn()` over `repeats` calls after one warm-up, synchronised on the device."""
    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    fn()
    sync()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def speculation_roofline(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    from verl_speco.speculation.roofline import QWEN3_8B, Hardware

    cuda = device.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    n_bytes = (1 << 30) if cuda else (64 << 20)  # a copy reads and writes this many bytes each
    src = torch.empty(n_bytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    copy_s = _timed(lambda: dst.copy_(src), device, 10)
    bytes_per_s = 2 * n_bytes / copy_s
    tokens, hidden, inter = (4096, 4096, 12288) if cuda else (256, 512, 1536)  # a Qwen3-8B MLP projection
    a = torch.randn(tokens, hidden, dtype=dtype, device=device)
    w = torch.randn(hidden, inter, dtype=dtype, device=device)
    mm_s = _timed(lambda: a @ w, device, 10)
    flops = 2 * tokens * hidden * inter / mm_s
    hw = Hardware(f"{torch.cuda.get_device_name(device) if cuda else 'cpu'} (measured)", bytes_per_s, flops)
    step_1 = QWEN3_8B.seconds(hw, 1, 1, 1024) + hw.step_overhead_s
    step_64 = QWEN3_8B.seconds(hw, 64, 64, 1024) + hw.step_overhead_s
    ok = all(math.isfinite(x) and x > 0 for x in (bytes_per_s, flops, step_1, step_64))
    return {"ok": ok, "hardware": {"name": hw.name, "bytes_per_s": bytes_per_s, "flops": flops},
            "qwen3_8b_step_ms": {"1": 1e3 * step_1, "64": 1e3 * step_64},
            "detail": f"copy {bytes_per_s / 1e9:.0f} GB/s, {str(dtype).split('.')[-1]} matmul {flops / 1e12:.1f} "
                      f"TFLOP/s; Qwen3-8B decode step on this roofline {1e3 * step_1:.2f} ms at batch 1, "
                      f"{1e3 * step_64:.2f} ms at batch 64 (context 1024)"}
