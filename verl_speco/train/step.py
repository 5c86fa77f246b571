"""One optimizer step over a rank's micro-batches, and held-out evaluation (global-batch normalised).

The global loss is L = sum_s w_s * (sum over micro-batches and ranks of num_s) / D_s, D_s the all-reduced
sum of den_s (docs/internals.md); with FSDP2 SUM-reducing gradients, the gradient is dL/dθ whatever the
split. A step whose global loss or gradient norm is not finite is skipped on every rank. `StepResult.timing`
gives seconds per stage (batch, forward, loss, backward, optim), device-synchronised at each boundary."""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from drafters.common.chunked_head import chunk_count_sync
from drafters.common.contract import DrafterFamily
from drafters.common.losses import ObjectiveOutput
from verl_speco.train.data import count_tokens, to_device
from verl_speco.train.distributed import all_reduce_max_int, all_reduce_sum


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    skipped: bool
    tokens: int
    metrics: dict[str, float] = field(default_factory=dict)
    timing: dict[str, float] = field(default_factory=dict)  # stage -> seconds (module docstring)


STAGES = ("batch", "forward", "loss", "backward", "optim")


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (no-op on CPU), so a host clock measures it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "npu":  # torch-npu registers the torch.npu module
        npu: Any = getattr(torch, "npu")  # noqa: B009 (absent from torch's stubs)
        npu.synchronize(device)


class StageTimer:
    """Accumulates seconds per stage; "forward" is the time inside calls of the model's root module or its
    direct children (outermost call only), so every family is measured alike; the rest is "loss"."""

    def __init__(self, device: torch.device):
        self.device = device
        self.seconds = dict.fromkeys(STAGES, 0.0)
        self._depth = 0
        self._forward_started = 0.0

    @contextmanager
    def stage(self, name: str) -> Iterator[None]:
        synchronize(self.device)
        t0 = time.perf_counter()
        try:
            yield
        finally:
            synchronize(self.device)
            self.seconds[name] += time.perf_counter() - t0

    def _enter(self, *_: Any) -> None:
        if self._depth == 0:
            synchronize(self.device)
            self._forward_started = time.perf_counter()
        self._depth += 1

    def _leave(self, *_: Any) -> None:
        self._depth -= 1
        if self._depth == 0:
            synchronize(self.device)
            self.seconds["forward"] += time.perf_counter() - self._forward_started

    @contextmanager
    def objective(self, model: nn.Module) -> Iterator[None]:
        """Time an objective call: its module calls go to "forward", the rest to "loss"."""
        modules = [model, *model.children()]
        handles = [h for m in modules for h in (m.register_forward_pre_hook(self._enter),
                                                 m.register_forward_hook(self._leave))]
        before = self.seconds["forward"]
        try:
            with self.stage("loss"):
                yield
        finally:
            for h in handles:
                h.remove()
            self._depth = 0
            self.seconds["loss"] -= self.seconds["forward"] - before


def _metric_pack(outs: Sequence[ObjectiveOutput]) -> tuple[list[str], Tensor]:
    """Names and [2, M] (sums; counts) of the objective metrics summed over micro-batches (on the
    metrics' device: no host sync here)."""
    names = sorted(outs[0].metrics)
    if not names:
        return names, outs[0].numerators.new_zeros(2, 0).detach().float()
    per_micro = [torch.stack([torch.stack([o.metrics[n][i].detach().float() for n in names]) for i in (0, 1)])
                 for o in outs]
    return names, torch.stack(per_micro).sum(0)


def _ratios(names: list[str], sums: Tensor) -> dict[str, float]:
    return {n: (float(sums[0, i] / sums[1, i]) if float(sums[1, i]) > 0 else float("nan"))
            for i, n in enumerate(names)}


def _grad_norm(params: list[nn.Parameter], max_norm: float) -> float:
    """Global grad norm (DTensor-aware); clips in place when `max_norm` > 0."""
    with_grad = [p for p in params if p.grad is not None]
    if not with_grad:
        return 0.0
    norm = torch.nn.utils.clip_grad_norm_(with_grad, max_norm if max_norm > 0 else float("inf"))
    full = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    return float(full)


def _fork_rng(device: torch.device) -> Any:
    """Run a pass without moving the RNG streams the real pass will use."""
    if device.type == "cpu":
        return torch.random.fork_rng(devices=[])
    return torch.random.fork_rng(devices=[device.index or 0], device_type=device.type)


def _objective(family: DrafterFamily, model: nn.Module, batch: dict[str, Tensor], progress: float,
               device: torch.device) -> ObjectiveOutput:
    """The family's objective with the chunked head's chunk counts equal on every rank (the max):
    a sharded head unit called once per chunk runs collectives per call (drafters/common/chunked_head.py)."""
    with chunk_count_sync(lambda n: all_reduce_max_int(n, device)):
        return family.objective(model, batch, progress)


def _backward(model: nn.Module, family: DrafterFamily, batches: list[dict[str, Tensor]], mode: str,
              device: torch.device, progress: float, timer: StageTimer) -> tuple[Tensor, list[ObjectiveOutput]]:
    """Back-propagate the globally normalised loss; returns (this rank's loss part, outputs)."""
    def objective(b: dict[str, Tensor]) -> ObjectiveOutput:
        with timer.objective(model):
            return _objective(family, model, b, progress, device)

    if mode == "retain":  # keep every micro-batch's graph until the denominators are known
        outs = [objective(b) for b in batches]
        global_den = all_reduce_sum(torch.stack([o.denominators.detach() for o in outs]).sum(0), device)
        local_loss = torch.stack([o.loss(global_den) for o in outs]).sum()
        with timer.stage("backward"):
            local_loss.backward()
        return local_loss.detach(), outs
    with torch.no_grad(), _fork_rng(device):  # "prepass": denominators first, one extra forward
        dens = torch.stack([objective(b).denominators for b in batches]).sum(0)
    global_den = all_reduce_sum(dens, device)
    parts, outs = [], []
    for b in batches:  # then forward + backward one micro-batch at a time (constant memory)
        out = objective(b)
        part = out.loss(global_den)
        with timer.stage("backward"):
            part.backward()
        out.numerators = out.numerators.detach()
        parts.append(part.detach())
        outs.append(out)
    return torch.stack(parts).sum(), outs


def train_step(model: nn.Module, family: DrafterFamily, micro: Sequence[list[dict[str, Tensor]]],
               optimizer: torch.optim.Optimizer, grad_clip: float, device: torch.device,
               mode: str = "retain", progress: float = 0.0) -> StepResult:
    """Forward every micro-batch, normalise by the global denominators, backward, clip, step. mode "retain":
    one backward over all; "prepass": a no-grad pass for the denominators, then one backward per micro-batch."""
    if not 0.0 <= progress <= 1.0:
        raise ValueError(f"progress: got {progress}, expected within [0, 1]")
    params = [p for g in optimizer.param_groups for p in g["params"]]
    timer = StageTimer(device)
    with timer.stage("batch"):
        batches = [to_device(family.collate(samples), device) for samples in micro]
    local_loss, outs = _backward(model, family, batches, mode, device, progress, timer)
    with timer.stage("optim"):
        names, msums = _metric_pack(outs)
        tokens = torch.stack([count_tokens(b) for b in batches]).sum()
        packed = torch.cat([torch.stack([local_loss.float(), tokens.float()]), msums.reshape(-1)])
        packed = all_reduce_sum(packed, device).cpu()
        loss = float(packed[0])
        grad_norm = _grad_norm(params, grad_clip)
        skipped = not (math.isfinite(loss) and math.isfinite(grad_norm))
        if not skipped:
            optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    metrics = _ratios(names, packed[2:].reshape(2, -1))
    return StepResult(loss, grad_norm, skipped, int(packed[1]), metrics, dict(timer.seconds))


@torch.no_grad()
def evaluate(model: nn.Module, family: DrafterFamily, micro: Iterable[list[dict[str, Tensor]]],
             device: torch.device) -> dict[str, float]:
    """Held-out loss (global normalisation) and the objective metrics, incl. `sim_accept_len`.

    Every rank must pass the same number of micro-batches; returns {} when there are none."""
    was_training = model.training
    model.eval()
    outs = []
    for samples in micro:
        out = _objective(family, model, to_device(family.collate(samples), device), 0.0, device)
        out.numerators = out.numerators.detach()
        outs.append(out)
    model.train(was_training)
    if not outs:
        return {}
    nums = torch.stack([o.numerators for o in outs]).sum(0).float()
    dens = torch.stack([o.denominators for o in outs]).sum(0).float()
    names, msums = _metric_pack(outs)
    s = nums.numel()
    packed = all_reduce_sum(torch.cat([nums, dens, msums.reshape(-1)]), device).cpu().double()
    nums, dens = packed[:s], packed[s:2 * s]
    weights = outs[0].weights.double().cpu()
    terms = torch.where(dens > 0, nums / dens.clamp_min(1e-30), torch.zeros_like(nums))
    return {"loss": float((weights * terms).sum()), **_ratios(names, packed[2 * s:].reshape(2, -1))}
