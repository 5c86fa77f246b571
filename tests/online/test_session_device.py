"""The online drafter off the CPU: the standalone recipe's bf16 mixed precision, and the target head
moved to the device once per version instead of on every optimizer step.

There is no accelerator here. Precision: a session on the meta device stands in for one on a GPU or
NPU (the session reads only the device type); the process group and FSDP2 calls are spies. Head
moves: the snapshot's tensors are a subclass that counts `.to(...)` calls and, as a host-to-device
copy does, returns a fresh tensor; on the real tiny target the rounds must also train exactly as the
old per-step `set_target_head` did.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch

from drafters.eagle3.family import FAMILY
from verl_speco.launchers.separate import GPU_TRAIN, NPU_TRAIN
from verl_speco.online import session as session_mod
from verl_speco.online.capture import CapturedRows
from verl_speco.online.config import DrafterRunConfig
from verl_speco.online.session import DrafterSession, TargetHeadSnapshot
from verl_speco.train.config import OptimConfig
from verl_speco.train.distributed import accelerator_mixed_precision


def _cfg(tmp: Path, **kw: Any) -> DrafterRunConfig:
    base: dict[str, Any] = {"enable": True, "settings": {"ttt_steps": 2}, "micro_batch_size": 2,
                            "train_steps_per_round": 6, "max_staleness": 1, "publish_dir": str(tmp / "pub"),
                            "optim": OptimConfig(lr=3e-3)}
    return DrafterRunConfig(**{**base, **kw}).validate()


def _recipe_dtype(overrides: list[str]) -> str:
    return next(o.split("=", 1)[1] for o in overrides if o.startswith("run.mixed_precision="))


def test_off_the_cpu_the_session_trains_in_the_recipes_bf16(tmp_path: Path, target_dir: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    group: list[torch.device] = []
    fsdp: list[tuple[torch.device, str | None]] = []
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: bool(group))
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: 0)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: 1)
    monkeypatch.setattr(session_mod, "init_single_process_group", group.append, raising=False)
    monkeypatch.setattr(session_mod, "apply_fsdp", lambda model, device, mp, **kw: fsdp.append((device, mp)),
                        raising=False)

    on_cpu = DrafterSession(_cfg(tmp_path), target_dir)
    assert group == [] and fsdp == []  # the CPU path is unchanged: float32, no FSDP2 alone

    session = DrafterSession(_cfg(tmp_path), target_dir, device="meta")
    meta = torch.device("meta")
    assert group == [meta]  # alone: a process group of one, for FSDP2
    assert fsdp == [(meta, "bfloat16")]
    assert (on_cpu.mixed_precision, session.mixed_precision) == (None, "bfloat16")
    assert _recipe_dtype(GPU_TRAIN) == _recipe_dtype(NPU_TRAIN) == "bfloat16"  # the standalone recipe's dtype
    assert [accelerator_mixed_precision(t) for t in ("cpu", "cuda", "npu")] == [None, "bfloat16", "bfloat16"]


class HostTensor(torch.Tensor):
    """A snapshot tensor in host memory: each `.to(...)` is counted and gives a new tensor."""

    moves: ClassVar[list[tuple[int, ...]]] = []

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **(kwargs or {}))
            if func is torch.Tensor.to:
                cls.moves.append(tuple(args[0].shape))
                out = out.clone()
        return out


def _rows(version: int, seed: int, n: int = 3, t: int = 9) -> CapturedRows:
    g = torch.Generator().manual_seed(seed)
    records = [{"input_ids": torch.randint(3, 505, (t,), generator=g), "loss_mask": torch.ones(t, dtype=torch.uint8),
                "aux_hidden": torch.randn(t, 3 * 128, generator=g), "last_hidden": torch.randn(t, 128, generator=g)}
               for _ in range(n)]
    return CapturedRows(records, version, {"kept": n})


def _head(version: int, host: bool) -> TargetHeadSnapshot:
    g = torch.Generator().manual_seed(100 + version)
    embed, lm = torch.randn(505, 128, generator=g), torch.randn(505, 128, generator=g)
    return TargetHeadSnapshot(version, embed.as_subclass(HostTensor) if host else embed,
                              lm.as_subclass(HostTensor) if host else lm)


def _train(session: DrafterSession, host: bool) -> None:
    torch.manual_seed(0)
    session.add(_rows(0, 0), _head(0, host))
    session.add(_rows(1, 1), _head(1, host))
    session.train_round()  # draws versions 0 and 1
    session.add(_rows(2, 2), _head(2, host))  # max_staleness 1: version 0 evicted
    session.train_round()  # versions 1 and 2


def test_the_head_moves_once_per_version_and_trains_as_before(tmp_path: Path, target_dir: Path) -> None:
    HostTensor.moves.clear()
    session = DrafterSession(_cfg(tmp_path), target_dir)
    _train(session, host=True)
    # embed and lm_head of versions 0, 1 (round 1) and 2 (round 2); a step used to move both: 2 * (6 + 1) a round
    assert HostTensor.moves == [(505, 128)] * 6
    model: Any = session.model
    assert torch.equal(model.target_lm_head, _head(2, False).lm_head)  # the latest version's head after a round

    reference = DrafterSession(_cfg(tmp_path), target_dir)  # the old per-step copy, on plain tensors
    def old_use_head(head: TargetHeadSnapshot) -> None:
        FAMILY.set_target_head(reference.model, head.embed_tokens, head.lm_head)

    reference._use_head = old_use_head  # type: ignore[method-assign]
    _train(reference, host=False)
    got, want = dict(session.model.named_parameters()), dict(reference.model.named_parameters())
    assert all(torch.equal(got[k], want[k]) for k in want)  # bit for bit
    assert reference.step == session.step == 12
    fresh: Any = DrafterSession(_cfg(tmp_path), target_dir).model
    assert not torch.equal(fresh.fc.weight, want["fc.weight"])  # it did train
