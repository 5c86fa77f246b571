"""Process group, device and FSDP2 setup for the trainer (applied from outside the model code).

- device / backend: auto -> cuda + nccl, else npu + hccl (`verl_speco.device`, the one torch_npu
  importer; HCCL has no float64 reduction, so npu sums run in float32), else cpu + gloo. torchrun
  uses the env:// rendezvous; a single process gets a private store, so the same FSDP2 path runs.
- FSDP2: each maximal proper submodule whose parameters are all trainable is one `fully_shard` unit
  (head modules run after the root's forward, and only a unit's own forward gathers its parameters),
  then the root with every frozen parameter ignored: frozen target pieces stay replicated plain
  tensors. Gradients are SUM-reduced: the objective is already normalised by global denominators."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist
from torch import nn

from verl_speco import device as device_mod
from verl_speco.train.config import ConfigError, TrainerConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    """run.device -> this rank's device (bound as the current one: LOCAL_RANK's accelerator)."""
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if name not in ("auto", *device_mod.DEVICE_TYPES):
        raise ConfigError(f"run.device={name!r}: expected auto, cpu, cuda or npu")
    if name == "auto":
        name = device_mod.accelerator_type()
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("run.device='cuda': torch.cuda.is_available() is False; expected auto or cpu "
                          "on this machine")
    if name == "npu" and device_mod.npu_device_count() == 0:
        raise ConfigError("run.device='npu': torch_npu is not importable or no NPU is visible; expected "
                          "auto or cpu on this machine")
    if name == "cpu":
        return torch.device("cpu")
    device_mod.set_current_device(name, local_rank)
    return torch.device(name, local_rank)


def resolve_backend(name: str, device: torch.device) -> str:
    """dist.backend -> the process group backend (auto: nccl, hccl or gloo by device type)."""
    if name != "auto":
        return name
    return device_mod.collective_backend(device.type)


def accelerator_mixed_precision(device_type: str) -> str | None:
    """The FSDP2 compute dtype a draft trains in on `device_type` when nothing asks otherwise: the GPU/NPU
    training recipe's bfloat16 (`run.mixed_precision`, over float32 weights) on accelerators; None
    (float32 throughout) on the CPU, which keeps CPU runs as they were, bit for bit."""
    return None if device_type == "cpu" else "bfloat16"


def init_single_process_group(device: torch.device, backend: str = "auto",
                              timeout: datetime.timedelta = datetime.timedelta(minutes=30)) -> None:
    """A default process group of one on a private in-memory store (no rendezvous): FSDP2 shards over
    a process group even in a single process. `backend` as `resolve_backend`."""
    dist.init_process_group(resolve_backend(backend, device), store=dist.HashStore(), rank=0, world_size=1,
                            timeout=timeout)


def init_distributed(cfg: TrainerConfig) -> tuple[torch.device, bool]:
    """Initialise the default process group; returns (device, whether this call created it)."""
    device = resolve_device(cfg.run.device)
    if dist.is_initialized():
        return device, False
    backend = resolve_backend(cfg.dist.backend, device)
    timeout = datetime.timedelta(seconds=cfg.dist.timeout_s)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        dist.init_process_group(backend, timeout=timeout)
    else:
        init_single_process_group(device, backend, timeout)
    return device, True


def _all_trainable(module: nn.Module) -> bool:
    params = list(module.parameters())
    return bool(params) and all(p.requires_grad for p in params)


def _has_forward(module: nn.Module) -> bool:
    """Whether the module's class defines a forward (nn.Module's own raises NotImplementedError)."""
    return type(module).forward is not nn.Module.forward


def _shard_units(module: nn.Module) -> list[nn.Module]:
    """Maximal submodules whose parameters are all trainable (pre-order). Modules without a forward
    of their own give their members instead: ModuleList/ModuleDict, which FSDP2 cannot wrap, and
    holders of pieces that are called by other methods (DSpark's Markov head: `features`, `bias`).
    FSDP2 gathers a unit's parameters around its forward only, so a unit reached through another
    method would compute with the local shards; its members' forwards are what runs."""
    units: list[nn.Module] = []
    for child in module.children():
        if not _has_forward(child):
            units.extend(_shard_units(child))
        elif _all_trainable(child):
            units.append(child)
        elif any(p.requires_grad for p in child.parameters()):
            units.extend(_shard_units(child))
    return units


def apply_fsdp(model: nn.Module, device: torch.device, mixed_precision: str | None,
               reshard_after_forward: bool) -> list[nn.Module]:
    """Shard `model` in place with FSDP2 over the default process group; returns the FSDP units (the
    root last). `mixed_precision`: compute dtype name (None: the parameters' own)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    mp = MixedPrecisionPolicy()
    if mixed_precision is not None:
        mp = MixedPrecisionPolicy(param_dtype=DTYPES[mixed_precision], reduce_dtype=torch.float32)
    units = _shard_units(model)  # also under an all-trainable root: objectives call head units outside its forward
    covered = {id(p) for u in units for p in u.parameters()}
    for unit in units:
        fully_shard(unit, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    frozen = {p for p in model.parameters() if not p.requires_grad and id(p) not in covered}
    fully_shard(model, mesh=mesh, mp_policy=mp, reshard_after_forward=reshard_after_forward, ignored_params=frozen or None)
    units.append(model)
    for unit in units:
        unit.set_gradient_divide_factor(1.0)  # type: ignore[operator]
        unit.set_force_sum_reduction_for_comms(True)  # type: ignore[operator]
    return units


def all_reduce_sum(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Sum over ranks (on `device`: NCCL/HCCL need device tensors, gloo CPU ones), in
    `collective_dtype` (float32 on npu: HCCL has no float64; float64 elsewhere)."""
    out = t.detach().to(device=device, dtype=device_mod.collective_dtype(t.dtype, device.type)).clone()
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(out)
    return out


def all_reduce_max_int(n: int, device: torch.device) -> int:
    """Max over ranks of a Python int (on `device`, as `all_reduce_sum`); `n` itself in a world of 1."""
    if not (dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1):
        return n
    t = torch.tensor([n], dtype=device_mod.collective_dtype(torch.int64, device.type), device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())
