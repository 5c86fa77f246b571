"""Device resolution with a faked accelerator probe, the collective backend and dtypes per device.

No NPU (and no torch_npu: installing it breaks `import torch` here) exists on CI, so the probe is
faked: `verl_speco.device._import_torch_npu` is replaced, `torch.npu` planted. The one check that
needs a real `torch.device("npu")` runs in a subprocess whose fake `torch_npu` package does what the
real one does at import (renames torch's privateuse1 backend to "npu" and attaches `torch.npu`).
Asserted: cuda wins over npu, npu over cpu; a torch_npu whose import fails in any way (a missing
CANN library) resolves to the CPU and refuses run.device=npu naming it; HCCL is chosen on npu; no
reduction on npu runs in float64 (nor int64), and the trainer's `all_reduce_sum` follows that.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from verl_speco import device as device_mod
from verl_speco.train import distributed
from verl_speco.train.config import ConfigError

ROOT = Path(__file__).resolve().parents[1]


class FakeNpu:
    def __init__(self, count: int):
        self.count, self.bound = count, [] if count else None

    def is_available(self) -> bool:
        return self.count > 0

    def device_count(self) -> int:
        return self.count

    def set_device(self, index: int) -> None:
        self.bound.append(index)


def fake_probe(monkeypatch: pytest.MonkeyPatch, *, cuda: bool, npus: int | None, error: BaseException | None = None) -> FakeNpu | None:
    """cuda availability; npus: visible NPUs (None: torch_npu absent); error: what importing it raises."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4 if cuda else 0)

    def importer() -> Any:
        if error is not None:
            raise error
        if npus is None:
            raise ModuleNotFoundError("No module named 'torch_npu'")
        return SimpleNamespace()

    monkeypatch.setattr(device_mod, "_import_torch_npu", importer)
    npu = FakeNpu(npus) if npus is not None and error is None else None
    if npu is not None:
        monkeypatch.setattr(torch, "npu", npu, raising=False)
    else:
        monkeypatch.delattr(torch, "npu", raising=False)
    return npu


@pytest.mark.parametrize(("cuda", "npus", "expected"), [(True, 8, "cuda"), (False, 8, "npu"), (False, 0, "cpu"),
                                                         (False, None, "cpu")])
def test_resolution_order(monkeypatch: pytest.MonkeyPatch, cuda: bool, npus: int | None, expected: str) -> None:
    fake_probe(monkeypatch, cuda=cuda, npus=npus)
    assert device_mod.accelerator_type() == expected
    assert device_mod.accelerator_count() == {"cuda": 4, "npu": 8, "cpu": 0}[expected]


@pytest.mark.parametrize("error", [OSError("libascendcl.so: cannot open shared object file"),
                                   ImportError("libhccl.so"), RuntimeError("CANN version mismatch"),
                                   AttributeError("module 'torch' has no attribute '_C._npu'")])
def test_a_broken_torch_npu_resolves_to_cpu_and_refuses_npu(monkeypatch: pytest.MonkeyPatch,
                                                            error: BaseException) -> None:
    fake_probe(monkeypatch, cuda=False, npus=8, error=error)
    assert device_mod.npu_device_count() == 0 and device_mod.accelerator_type() == "cpu"
    assert distributed.resolve_device("auto") == torch.device("cpu")
    with pytest.raises(ConfigError, match=r"run.device='npu': torch_npu is not importable or no NPU is visible"):
        distributed.resolve_device("npu")


def test_device_module_never_imports_torch_npu_at_import() -> None:
    code = "import sys, verl_speco.device, verl_speco.train.distributed; print('torch_npu' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, cwd=ROOT)
    assert out.stdout.strip() == "False"


def test_hccl_is_chosen_on_npu() -> None:
    assert {t: device_mod.collective_backend(t) for t in device_mod.DEVICE_TYPES} == \
        {"cuda": "nccl", "npu": "hccl", "cpu": "gloo"}
    assert distributed.resolve_backend("auto", SimpleNamespace(type="npu")) == "hccl"  # type: ignore[arg-type]
    assert distributed.resolve_backend("gloo", SimpleNamespace(type="npu")) == "gloo"  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"device type: got 'tpu', expected one of cuda, npu, cpu"):
        device_mod.collective_backend("tpu")


def test_no_float64_reduction_on_npu() -> None:
    for dtype in (torch.float64, torch.float32, torch.bfloat16, torch.float16):
        assert device_mod.collective_dtype(dtype, "npu") == torch.float32
        assert device_mod.collective_dtype(dtype, "cpu") == device_mod.collective_dtype(dtype, "cuda") == torch.float64
    assert device_mod.collective_dtype(torch.int64, "npu") == torch.int32
    assert device_mod.collective_dtype(torch.int64, "cuda") == torch.int64


def test_all_reduce_sum_reduces_in_the_device_dtype(monkeypatch: pytest.MonkeyPatch) -> None:
    """The trainer's sum asks `collective_dtype` for its dtype (planted: a float64 answer on npu
    would reach the all-reduce; here the CPU path shows the dtype is the helper's, not a constant)."""
    asked: list[tuple[torch.dtype, str]] = []
    real = device_mod.collective_dtype

    def spy(dtype: torch.dtype, device_type: str) -> torch.dtype:
        asked.append((dtype, device_type))
        return torch.float32 if device_type == "cpu" else real(dtype, device_type)

    monkeypatch.setattr(device_mod, "collective_dtype", spy)
    out = distributed.all_reduce_sum(torch.ones(3, dtype=torch.float64), torch.device("cpu"))
    assert out.dtype == torch.float32 and asked == [(torch.float64, "cpu")]


def test_ray_asks_for_npus_as_the_npu_resource() -> None:
    assert device_mod.ray_accelerator_options("npu", 1) == {"num_gpus": 0, "resources": {"NPU": 1}}
    assert device_mod.ray_accelerator_options("cuda", 2) == {"num_gpus": 2}


FAKE_TORCH_NPU = '''
import torch

class _Npu:
    bound = []
    @staticmethod
    def is_available(): return True
    @staticmethod
    def device_count(): return 2
    @staticmethod
    def set_device(i): _Npu.bound.append(i)

torch.utils.rename_privateuse1_backend("npu")
torch.npu = _Npu
'''


def test_npu_resolves_to_a_bound_npu_device_with_a_fake_torch_npu(tmp_path: Path) -> None:
    (tmp_path / "torch_npu").mkdir()
    (tmp_path / "torch_npu" / "__init__.py").write_text(FAKE_TORCH_NPU)
    code = textwrap.dedent("""
        import torch
        from verl_speco import device
        from verl_speco.train.distributed import resolve_backend, resolve_device
        torch.cuda.is_available = lambda: False
        d = resolve_device("auto")
        print(d, resolve_backend("auto", d), torch.npu.bound, device.accelerator_count())
    """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)]), "LOCAL_RANK": "1"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["npu:1", "hccl", "[1]", "2"]
