"""`DrafterWorker`: the Ray actor that hosts the online `DrafterSession` of an RL run.

The actor workers put their captured rows into Ray's object store as safetensors bytes
(`CapturedRows.to_bytes`, `TargetHeadSnapshot.to_bytes`: nothing of ours is unpickled) and hand
the trainer object references only; the trainer passes the references here, so feature tensors
travel worker -> drafter directly and never through the trainer process. Rank 0 also sends the
target-head snapshot of the policy version the rows came from (the other ranks' rows of that step
share it).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import ray
import torch

from verl_speco.online.config import DrafterRunConfig

ACTOR_NAME_PREFIX = "verl_speco_drafter"


def drafter_device() -> str:
    """The accelerator Ray gave this actor, else the CPU."""
    return "cuda" if torch.cuda.is_available() else "cpu"


class DrafterWorker:
    """Holds the session; every method is called by the trainer (one call at a time)."""

    def __init__(self, drafter: dict[str, Any], target_dir: str, run_name: str):
        from verl_speco.online.session import DrafterSession

        self.cfg = DrafterRunConfig.from_dict(drafter)
        self.session = DrafterSession(self.cfg, target_dir, device=drafter_device(), run_name=run_name)
        self.rows_added = 0
        self.tokens_added = 0

    def layer_ids(self) -> list[int]:
        """Internal layer ids the drafter needs from the actor's forward (HF hidden_states indexing)."""
        layout = self.session.family.required_layout(self.session.fam_cfg, self.session.target_spec)
        return [int(i) for i in layout.layer_ids]

    def target_shape(self) -> dict[str, int]:
        spec = self.session.target_spec
        return {"hidden_size": int(spec.hidden_size), "vocab_size": int(spec.vocab_size)}

    def export_initial(self, out_dir: str) -> str:
        """The current draft as an engine-loadable directory (the rollout engine starts from it)."""
        s = self.session
        return str(s.family.export(s.model, s.fam_cfg, s.target_spec, Path(out_dir), fmt="native"))

    def add(self, rows_refs: list[Any], head_ref: Any) -> dict[str, float]:
        """Buffer the rows of one RL step (object refs from every actor rank) with their head."""
        from verl_speco.online.capture import CapturedRows
        from verl_speco.online.session import TargetHeadSnapshot

        started = time.perf_counter()
        head = TargetHeadSnapshot.from_bytes(ray.get(head_ref))
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

    def buffered_tokens(self) -> int:
        return int(self.session.buffer.tokens)

    def train_round(self) -> dict[str, float]:
        return self.session.train_round()

    def publish(self) -> dict[str, Any]:
        started = time.perf_counter()
        published = self.session.publish()
        return {"version": int(published.version), "path": str(published.path),
                "bytes": int(published.total_bytes), "seconds": time.perf_counter() - started}


def start_drafter_worker(drafter: DrafterRunConfig, target_dir: str, run_name: str,
                         num_gpus: float = 0.0) -> Any:
    """Start the named drafter actor. It reserves no CPU (a 2-core machine would deadlock with
    verl's own placement groups); `num_gpus` > 0 gives it an accelerator outside verl's pools."""
    import dataclasses

    remote_cls = ray.remote(DrafterWorker)
    return remote_cls.options(name=f"{ACTOR_NAME_PREFIX}_{run_name}", num_cpus=0, num_gpus=num_gpus,
                              max_concurrency=1).remote(dataclasses.asdict(drafter), target_dir, run_name)
