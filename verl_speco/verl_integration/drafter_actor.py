"""The drafter worker group of an RL run: Ray actors (`DrafterWorker`), one rank of the online
`DrafterSession` each (FSDP2 when several); `DrafterGroup.method.remote(...)` calls every rank and returns
rank 0's ref. Rows and head snapshots travel as safetensors bytes, worker -> drafter, never via the trainer."""

from __future__ import annotations

import datetime
import os
import time
from typing import Any

import ray
import torch.distributed as dist

from verl_speco.device import (
    accelerator_type,
    collective_backend,
    local_accelerator_index,
    ray_accelerator_options,
    set_current_device,
)
from verl_speco.online.config import DrafterRunConfig
from verl_speco.ports import free_port

ACTOR_NAME_PREFIX = "verl_speco_drafter"


def drafter_device() -> tuple[str, int | None]:
    """(device type, torch index) of the accelerator Ray gave this actor, ("cpu", None) without one;
    the index from Ray's accelerator ids (`device.local_accelerator_index`), not 0."""
    kind = accelerator_type()
    if kind == "cpu":
        return kind, None
    return kind, local_accelerator_index(kind, ray.get_runtime_context().get_accelerator_ids(), os.environ)


class DrafterWorker:
    """One rank: holds its session; every method is called by the trainer (one call at a time)."""

    def __init__(self, drafter: dict[str, Any], target_dir: str, run_name: str, rank: int = 0,
                 world_size: int = 1, master: tuple[str, int] | None = None):
        from verl_speco.online.session import DrafterSession

        self.cfg = DrafterRunConfig.from_dict(drafter)
        kind, index = drafter_device()
        if index is not None:  # at every world size: a bare "npu"/"cuda" device means the current one
            set_current_device(kind, index)
        if world_size > 1:  # every rank's constructor runs at once; this returns when all have joined
            if master is None:
                raise ValueError(f"DrafterWorker rank {rank} of {world_size}: master (host, port) is required")
            dist.init_process_group(collective_backend(kind), init_method=f"tcp://{master[0]}:{master[1]}",
                                    rank=rank, world_size=world_size, timeout=datetime.timedelta(minutes=30))
        device = kind if index is None else f"{kind}:{index}"
        self.session = DrafterSession(self.cfg, target_dir, device=device, run_name=run_name)
        self.rows_added = 0
        self.tokens_added = 0

    def rank(self) -> int:
        return int(self.session.rank)

    def layer_ids(self) -> list[int]:
        """Internal layer ids the drafter needs from the actor's forward (HF hidden_states indexing)."""
        layout = self.session.family.required_layout(self.session.fam_cfg, self.session.target_spec)
        return [int(i) for i in layout.layer_ids]

    def engine_format(self) -> dict[str, Any]:
        """The draft's engine format (`EngineFormat.to_dict()`: the rollout engines' speculative arguments)."""
        return self.session.engine_format.to_dict()

    def target_shape(self) -> dict[str, int]:
        spec = self.session.target_spec
        return {"hidden_size": int(spec.hidden_size), "vocab_size": int(spec.vocab_size)}

    def export_initial(self, out_dir: str) -> str:
        """The current draft as an engine-loadable directory (the rollout engine starts from it)."""
        return str(self.session.export(out_dir))

    def add(self, rows_refs: list[Any], head: Any) -> dict[str, float]:
        """Buffer the rows of one RL step (object refs from every actor rank, in a list: fetched here)
        with their head (safetensors bytes: Ray resolves a ref passed as a top-level argument)."""
        from verl_speco.online.capture import CapturedRows
        from verl_speco.online.session import TargetHeadSnapshot

        started = time.perf_counter()
        head = TargetHeadSnapshot.from_bytes(head if isinstance(head, bytes) else ray.get(head))
        added_rows = added_tokens = 0
        for data in ray.get(list(rows_refs)):
            rows = CapturedRows.from_bytes(data)
            self.session.add(rows, head)
            added_rows += len(rows.records)
            added_tokens += rows.num_tokens
        self.rows_added += added_rows
        self.tokens_added += added_tokens
        return {"rows_added": float(added_rows), "tokens_added": float(added_tokens),
                "buffer_tokens": float(self.session.buffer.tokens),
                "add_seconds": time.perf_counter() - started}

    def next_round_steps(self) -> int:
        return int(self.session.next_round_steps())

    def train_round(self) -> dict[str, float]:
        return self.session.train_round()

    def publish(self) -> dict[str, Any]:
        """Every rank gathers the draft (a collective); rank 0 writes the version and answers."""
        started = time.perf_counter()
        published = self.session.publish()
        if published is None:
            return {"version": int(self.session.version), "path": None, "bytes": 0, "seconds": 0.0}
        return {"version": int(published.version), "path": str(published.path),
                "bytes": int(published.total_bytes), "seconds": time.perf_counter() - started}


@ray.remote(num_cpus=0)
def _rank0_answer(*answers: Any) -> Any:
    return answers[0]


class DrafterGroup:
    """The trainer's handle on the drafter ranks (module docstring)."""

    def __init__(self, actors: list[Any]):
        self.actors = list(actors)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        actors = self.actors

        class _Method:
            @staticmethod
            def remote(*args: Any) -> Any:
                refs = [getattr(a, name).remote(*args) for a in actors]
                return refs[0] if len(refs) == 1 else _rank0_answer.remote(*refs)

        return _Method()


class RayDrafterLink:
    """`online.controller.DrafterLink` over the group: each call is one round trip to every rank, except
    `start_round`, whose handle is the round's object ref (the ranks train while the trainer goes on)."""

    def __init__(self, group: Any):
        self.group = group

    def add(self, rows: list[Any], head: Any) -> dict[str, float]:
        return dict(ray.get(self.group.add.remote(rows, head)))

    def next_round_steps(self) -> int:
        return int(ray.get(self.group.next_round_steps.remote()))

    def start_round(self) -> Any:
        return self.group.train_round.remote()

    def wait_round(self, handle: Any) -> dict[str, float]:
        return dict(ray.get(handle))

    def publish(self) -> dict[str, Any]:
        return dict(ray.get(self.group.publish.remote()))


@ray.remote(num_cpus=0)
def _rendezvous() -> tuple[str, int]:
    return ray.util.get_node_ip_address(), free_port()


def start_drafter_group(drafter: DrafterRunConfig, target_dir: str, run_name: str,
                        device_type: str = "cuda") -> DrafterGroup:
    """Start `drafter.num_workers` named actors, each with `drafter.num_gpus` accelerators of
    `device_type`, outside verl's pools and with no CPU reservation (a 2-core machine would deadlock with
    verl's placement groups); several form one process group pinned to one node."""
    import dataclasses

    world = int(drafter.num_workers)
    raw = dataclasses.asdict(drafter)
    remote_cls = ray.remote(DrafterWorker)
    master = ray.get(_rendezvous.remote()) if world > 1 else None
    options: dict[str, Any] = {"num_cpus": 0, "max_concurrency": 1,
                               **ray_accelerator_options(device_type, drafter.num_gpus)}
    if world > 1 and master is not None:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        node = next(n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeManagerAddress"] == master[0])
        options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id=node, soft=False)
    actors = [remote_cls.options(name=f"{ACTOR_NAME_PREFIX}_{run_name}_{rank}", **options)
              .remote(raw, target_dir, run_name, rank, world, master) for rank in range(world)]
    return DrafterGroup(actors)
