"""Rollout servers that take published drafts: vLLM worker extension, HTTP server and replica.

`SpecoVLLMHttpServer` gives verl's vLLM engine `SpecoWorkerExtension` (verl's extension plus
`engines.vllm_reload.DraftReloadMixin` and `engines.draft_digest.DraftDigestMixin`) and calls those
methods on every worker through `collective_rpc`, returning the answers. `install_replica_class`
registers `SpecoVLLMReplica` as verl's "vllm" rollout replica. Importing this needs a `vllm`
distribution (the CPU wheel needs an alias, docs/design/environment.md section 1)."""

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
        """`method` (one of DRAFT_METHODS) on every engine worker of this server; their answers (only
        the node-rank-0 server owns the engine client; the others answer [])."""
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
