"""Which accelerator a drafter rank binds: the index from Ray's accelerator ids, with faked Ray contexts.

Ray narrows CUDA_VISIBLE_DEVICES / ASCEND_RT_VISIBLE_DEVICES to an actor's ids unless
RAY_EXPERIMENTAL_NOSET_<variable> is set (scripts/lib/launch.sh sets it for NPUs), so the torch index
is the id's position in that variable, or the id itself when the variable is unset. Asserted on
`local_accelerator_index` (hand-written cases, one clear error per bad input) and on `DrafterWorker`
(faked `ray.get_runtime_context`, device probe, process group and session): each rank binds its own
device at every world size and its session gets that indexed device, never a bare "npu" (NPU 0).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import ray

from verl_speco import device as device_mod
from verl_speco.device import local_accelerator_index
from verl_speco.online import session as session_mod
from verl_speco.verl_integration import drafter_actor

NOSET = {"cuda": "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES", "npu": "RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES"}


@pytest.mark.parametrize(("kind", "ids", "environ", "expected"), [
    ("npu", {"GPU": [], "NPU": ["5"]}, {"ASCEND_RT_VISIBLE_DEVICES": "5"}, 0),  # narrowed by Ray
    ("npu", {"NPU": ["5"]}, {NOSET["npu"]: "1"}, 5),  # NOSET, nothing listed: the id is the ordinal
    ("npu", {"NPU": ["5"]}, {NOSET["npu"]: "1", "ASCEND_RT_VISIBLE_DEVICES": "4,5,6,7"}, 1),
    ("npu", {"NPU": ["7", "6"]}, {NOSET["npu"]: "1", "ASCEND_RT_VISIBLE_DEVICES": "4,5,6,7"}, 2),  # the lowest
    ("cuda", {"GPU": ["3"], "NPU": []}, {"CUDA_VISIBLE_DEVICES": "3"}, 0),  # Ray's default for GPUs
    ("cuda", {"GPU": ["6"]}, {NOSET["cuda"]: "1", "CUDA_VISIBLE_DEVICES": "4,5,6,7"}, 2),
    ("cuda", {"GPU": ["2"]}, {NOSET["cuda"]: "1"}, 2),
    ("cuda", {"GPU": ["GPU-ab12"]}, {"CUDA_VISIBLE_DEVICES": "GPU-ff00,GPU-ab12"}, 1),  # UUIDs
])
def test_local_index_from_ray_ids(kind: str, ids: dict[str, list[str]], environ: dict[str, str],
                                  expected: int) -> None:
    assert local_accelerator_index(kind, ids, environ) == expected


def test_local_index_refuses_what_it_cannot_place() -> None:
    with pytest.raises(ValueError, match=r"no 'NPU' id for this worker"):
        local_accelerator_index("npu", {"GPU": ["0"], "NPU": []}, {})
    with pytest.raises(ValueError, match=r"ASCEND_RT_VISIBLE_DEVICES='0,1' does not list Ray's NPU ids \['5'\]"):
        local_accelerator_index("npu", {"NPU": ["5"]}, {"ASCEND_RT_VISIBLE_DEVICES": "0,1"})
    with pytest.raises(ValueError, match=r"ids \['GPU-ab12'\] with CUDA_VISIBLE_DEVICES unset: expected device ordinals"):
        local_accelerator_index("cuda", {"GPU": ["GPU-ab12"]}, {})
    with pytest.raises(ValueError, match=r"device type: got 'cpu', expected one of cuda, npu"):
        local_accelerator_index("cpu", {}, {})


def _start(monkeypatch: pytest.MonkeyPatch, kind: str, ids: dict[str, list[str]], environ: dict[str, str],
           rank: int = 0, world: int = 1) -> dict[str, list[Any]]:
    """A `DrafterWorker` built under a faked Ray context; what it bound, joined and handed its session."""
    seen: dict[str, list[Any]] = {"bound": [], "groups": [], "sessions": []}
    for var in (*device_mod.VISIBLE_DEVICES.values(), *NOSET.values()):
        monkeypatch.delenv(var, raising=False)
    for key, value in environ.items():
        monkeypatch.setenv(key, value)

    def context() -> Any:
        if kind == "cpu":
            raise AssertionError("a CPU drafter asked Ray for accelerator ids")
        return SimpleNamespace(get_accelerator_ids=lambda: ids)

    class Session:
        def __init__(self, cfg: Any, target_dir: str, device: str, run_name: str):
            seen["sessions"].append(device)

    monkeypatch.setattr(ray, "get_runtime_context", context)
    monkeypatch.setattr(drafter_actor, "accelerator_type", lambda: kind)
    monkeypatch.setattr(drafter_actor, "set_current_device", lambda t, i: seen["bound"].append((t, i)))
    monkeypatch.setattr(drafter_actor.dist, "init_process_group",
                        lambda backend, **kw: seen["groups"].append((backend, kw["rank"], kw["world_size"])))
    monkeypatch.setattr(session_mod, "DrafterSession", Session)
    drafter_actor.DrafterWorker({"enable": True}, "target", "run", rank=rank, world_size=world,
                                master=("127.0.0.1", 29500) if world > 1 else None)
    return seen


def test_npu_ranks_bind_their_own_npu_when_ray_does_not_narrow_visibility(monkeypatch: pytest.MonkeyPatch) -> None:
    """The NPU launcher's NOSET: rank 1 holds NPU 5 and binds 5 (it bound 0, beside verl's rank 0)."""
    seen = _start(monkeypatch, "npu", {"GPU": [], "NPU": ["5"]}, {NOSET["npu"]: "1"}, rank=1, world=2)
    assert seen == {"bound": [("npu", 5)], "groups": [("hccl", 1, 2)], "sessions": ["npu:5"]}


def test_a_single_npu_drafter_binds_and_names_its_npu(monkeypatch: pytest.MonkeyPatch) -> None:
    """World size 1: no device was bound and the session used torch.device("npu"), i.e. NPU 0."""
    seen = _start(monkeypatch, "npu", {"NPU": ["3"]}, {NOSET["npu"]: "1", "ASCEND_RT_VISIBLE_DEVICES": "0,1,2,3"})
    assert seen == {"bound": [("npu", 3)], "groups": [], "sessions": ["npu:3"]}


def test_cuda_under_ray_narrowing_and_under_noset(monkeypatch: pytest.MonkeyPatch) -> None:
    """GPUs: Ray narrows CUDA_VISIBLE_DEVICES by default (index 0); a NOSET set from outside keeps the list."""
    narrowed = _start(monkeypatch, "cuda", {"GPU": ["6"]}, {"CUDA_VISIBLE_DEVICES": "6"}, rank=0, world=2)
    assert narrowed == {"bound": [("cuda", 0)], "groups": [("nccl", 0, 2)], "sessions": ["cuda:0"]}
    noset = _start(monkeypatch, "cuda", {"GPU": ["6"]}, {NOSET["cuda"]: "1", "CUDA_VISIBLE_DEVICES": "4,5,6,7"},
                   rank=0, world=2)
    assert noset == {"bound": [("cuda", 2)], "groups": [("nccl", 0, 2)], "sessions": ["cuda:2"]}


def test_a_cpu_drafter_binds_nothing_and_never_asks_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    assert _start(monkeypatch, "cpu", {}, {}) == {"bound": [], "groups": [], "sessions": ["cpu"]}
