"""One training step of every family's debug draft (float64), for tests/train/test_fsdp_family_grads.py.

`family_step` runs the trainer's `train_step` on one global batch split over the ranks (rank r of W
gets samples r, r + W, ...) and returns every parameter's full gradient (DTensor shards gathered)
as the optimizer sees it. Without a process group it is the plain 1-process step (no FSDP).

As a script, one rank of a gloo group (file:// rendezvous):
    python fsdp_grads_worker.py RANK WORLD_SIZE INIT_FILE OUT.pt
shards each family's draft with the trainer's `apply_fsdp` (reshard after forward), with FSDP2's
"returned a view tensor" warning turned into an error, and rank 0 saves
{family: {"grads": {name: full grad}, "planted": {...}}} ("planted", W > 1 only: the same step
with the last rank's batch altered), after checking that the error filter catches a planted view-returning module.
"""

from __future__ import annotations

import faulthandler
import gc
import os
import sys
import traceback
import warnings
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "drafters"))
from test_family_contract import SPEC, _build, _config, _random_samples, _target  # noqa: E402

from drafters.registry import available_families, get_family  # noqa: E402
from verl_speco.train.step import train_step  # noqa: E402

FAMILIES = available_families()
LENGTHS = (11, 7, 5, 11)  # the global batch: 4 samples; every rank pads to 11 as 1 rank does (the norms
# compute in float32: a float64 summation-order difference (another padded length) can flip a float32 ulp)
CHUNK_ROWS = 5  # loss_chunk_rows: several chunks per micro-batch, so FSDP meets the checkpoint recompute
GROUP_TIMEOUT_S = 120  # a rank lost mid-step fails its peers in 2 minutes, not gloo's default 30
VIEW_WARNING = r"FSDP2-wrapped module .* returned a view tensor"  # torch's text (fsdp/_fully_shard/_fsdp_state.py)


class GradRecorder(torch.optim.SGD):
    """An optimizer whose step records every parameter's full gradient (and updates nothing)."""

    def __init__(self, named: list[tuple[str, nn.Parameter]]):
        super().__init__([p for _, p in named], lr=0.0)
        self.names = {id(p): n for n, p in named}
        self.grads: dict[str, Tensor] = {}

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    g = p.grad
                    self.grads[self.names[id(p)]] = (g.full_tensor() if hasattr(g, "full_tensor") else g).clone()


def family_case(name: str) -> tuple[Any, nn.Module, list[dict[str, Tensor]]]:
    """(family, float64 train-mode draft with loss_chunk_rows = CHUNK_ROWS, float64 samples): the
    debug target and config of tests/drafters/test_family_contract.py."""
    family = get_family(name)
    target = _target(SPEC, seed=0)
    cfg = _config(family, SPEC)
    samples = _random_samples(family, cfg, target, LENGTHS, seed=2)
    model = _build(family, cfg, target, samples, seed=1).double().train()
    model = family.with_settings(model, loss_chunk_rows=CHUNK_ROWS)
    samples = [{k: v.double() if v.is_floating_point() else v for k, v in s.items()} for s in samples]
    return family, model, samples


def family_step(family: Any, model: nn.Module, samples: list[dict[str, Tensor]], rank: int = 0,
                world_size: int = 1) -> dict[str, Tensor]:
    """The trainer's step (retained graphs, no clipping) on this rank's share of `samples`: {name: full grad}."""
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    opt = GradRecorder(named)
    torch.manual_seed(7)  # anchors, COD draws: the same draw on every rank and in every run
    result = train_step(model, family, [samples[rank::world_size]], opt, grad_clip=0.0,
                        device=torch.device("cpu"), mode="retain", progress=0.3)
    assert not result.skipped and opt.grads, (family.name, result)
    assert opt.grads.keys() == {n for n, _ in named}, family.name
    return opt.grads


def _planted_view_is_an_error() -> None:
    """The error filter matches FSDP2's warning: a sharded module returning a view raises."""
    from torch.distributed.fsdp import fully_shard

    class ViewOut(nn.Linear):
        def forward(self, x: Tensor) -> Tensor:
            return super().forward(x).view(-1)

    m = ViewOut(3, 2).double()
    fully_shard(m)
    try:
        m(torch.ones(2, 3, dtype=torch.float64))
    except UserWarning as e:
        assert "returned a view tensor" in str(e), e
    else:
        raise AssertionError("FSDP2's view warning was not raised as an error")


def main(rank: int, world_size: int, init_file: str, out: str) -> None:
    import torch.distributed as dist

    from verl_speco.train.distributed import apply_fsdp

    torch._C.set_num_threads(1)
    warnings.filterwarnings("error", message=VIEW_WARNING)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=GROUP_TIMEOUT_S))
    _planted_view_is_an_error()
    results: dict[str, dict[str, dict[str, Tensor]]] = {}
    for name in FAMILIES:
        family, model, samples = family_case(name)
        apply_fsdp(model, torch.device("cpu"), mixed_precision=None, reshard_after_forward=True)
        results[name] = {"grads": family_step(family, model, samples, rank, world_size)}
        if world_size > 1:
            planted = list(samples)
            planted[world_size - 1] = samples[0]  # the last rank's first sample replaced by rank 0's
            results[name]["planted"] = family_step(family, model, planted, rank, world_size)
        del model  # the sharded draft holds the group (its mesh): none may outlive destroy_process_group
    if rank == 0:
        torch.save(results, out)
    dist.barrier()  # no rank tears its group down while another still uses it
    gc.collect()
    dist.destroy_process_group()


def run(argv: list[str]) -> int:
    """`main` as a process: 0 when it returned, 1 (with the traceback) when it raised. The caller
    ends the process with `os._exit`: a gloo group's threads met in interpreter teardown abort the
    process at random ("terminate called without an active exception", seen on CI on the rank that
    finished first) although every step passed."""
    try:
        main(int(argv[0]), int(argv[1]), argv[2], argv[3])
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


if __name__ == "__main__":
    faulthandler.enable()  # a crash in native code still names the Python line it was on
    code = run(sys.argv[1:])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
