"""What the rollout servers and replicas of both engines answer for the drafter, and the SGLang server:
`replica.speco_call(method, args)` (`DRAFT_METHODS`: load a verified version, re-apply, report version or
digest, baseline and restore; a refused load leaves the previous draft serving) and
`replica.speco_spec_counters()`. `SGLangDraftServerMixin` sends a verified version to its server's own HTTP
address from a thread; `install_sglang_replica_class` imports sglang only when verl asks for it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

from verl_speco.engines.spec_metrics import SpecCounters

DRAFT_METHODS = ("speco_load_draft", "speco_reapply_draft", "speco_draft_version", "speco_apply_baseline",
                 "speco_restore_draft", "speco_draft_digest")
SGLANG_REQUEST_TIMEOUT_S = 600.0


def check_method(method: str) -> None:
    if method not in DRAFT_METHODS:
        raise ValueError(f"speco_call: method {method!r}, expected one of {DRAFT_METHODS}")


class SpecoReplicaMixin:
    """Replica side: every server of the replica (`self.servers`, Ray actor handles) answers."""

    servers: list[Any]

    async def speco_call(self, method: str, args: tuple = (), timeout: float | None = None) -> list[Any]:
        check_method(method)
        answers: list[list[Any]] = await asyncio.gather(*[server.speco_call.remote(method, tuple(args), timeout)
                                                          for server in self.servers])
        return [a for per_server in answers for a in per_server]

    async def speco_spec_counters(self) -> SpecCounters:
        """Spec-decode counters summed over this replica's servers."""
        answers: list[dict[str, Any]] = await asyncio.gather(
            *[server.speco_spec_counters.remote() for server in self.servers])
        total = SpecCounters()
        for answer in answers:
            total = total + SpecCounters.from_dict(answer)
        return total


def publish_engine_format(path: str | Path) -> Any:
    """The family engine format a published version was written for (its manifest's
    meta.engine_format, `EngineFormat.to_dict()`); `PublishRejected` when unusable or absent."""
    from drafters.registry import RegistryError, engine_format_from_dict
    from verl_speco.online.publish import PublishRejected, read_manifest

    meta = read_manifest(path).get("meta", {})
    if not isinstance(meta, dict) or not isinstance(meta.get("engine_format"), dict):
        raise PublishRejected("manifest", f"{path}: the publish manifest has no meta.engine_format (written by "
                                          "DrafterSession.publish); an SGLang server cannot build its update "
                                          "without it")
    try:
        return engine_format_from_dict(meta["engine_format"])
    except (TypeError, ValueError, RegistryError) as e:
        raise PublishRejected("manifest", f"{path}: meta.engine_format: {e}") from None


class SGLangDraftServerMixin:
    """In front of verl's `SGLangHttpServer`: the draft-reload calls (module docstring), from node 0,
    one request entry per TP rank."""

    node_rank: int
    config: Any
    get_server_address: Callable[[], tuple[str, int]]  # verl's (annotation only: the server class has it)
    speco_serialize: Any = None  # None: SGLang's own serializer (engines/sglang_engine.py)
    _speco_publisher: Any = None
    _speco_spec: dict[str, Any] | None = None

    def _speco_client(self) -> Any:
        from verl_speco.engines.sglang_http import SGLangHTTPClient

        host, port = self.get_server_address()
        host = f"[{host}]" if ":" in host else host  # IPv6
        return SGLangHTTPClient(f"http://{host}:{port}", timeout_s=SGLANG_REQUEST_TIMEOUT_S)

    def _speco_expected(self) -> dict[str, Any] | None:
        """(shape, dtype) per checkpoint name of the draft SGLang started from, else of the first version
        this server accepted; None before either is known."""
        if self._speco_spec is None:
            from verl_speco.online.publish import checkpoint_spec

            kwargs = getattr(getattr(self.config, "engine_kwargs", None), "sglang", None)
            draft = getattr(kwargs, "speculative_draft_model_path", None) if kwargs is not None else None
            if draft and Path(str(draft)).is_dir():
                self._speco_spec = checkpoint_spec(str(draft))
        return self._speco_spec

    def _speco_answer(self, status: str, reason: str = "") -> dict[str, Any]:
        latest = None if self._speco_publisher is None else self._speco_publisher.latest_version
        return {"status": status, "version": -1 if latest is None else int(latest), "reason": reason}

    def _speco_load(self, path: str, version: int) -> dict[str, Any]:
        """Verify the version completely (`publish.verify_version`) before anything is sent; a
        failure while sending re-sends the previous version (the draft SGLang held before)."""
        from verl_speco.engines.sglang_publish import SGLangDraftPublisher
        from verl_speco.online.publish import PublishRejected, load_version, stale_reason, tensor_spec

        held = None if self._speco_publisher is None else self._speco_publisher.latest_version
        stale = stale_reason(version, held)
        if stale is not None:
            self._speco_publisher.dropped += 1
            return self._speco_answer("stale", stale)
        try:
            cfg = publish_engine_format(path)
            if self._speco_publisher is not None and self._speco_publisher.cfg != cfg:
                raise PublishRejected("manifest", f"{path}: engine format differs from the draft this server "
                                                  "was publishing")
            state = load_version(path, version, self._speco_expected())
        except PublishRejected as e:
            return self._speco_answer("rejected", f"{e.reason}: {e}")
        if self._speco_publisher is None:
            tp = int(getattr(self.config, "tensor_model_parallel_size", 1) or 1)
            self._speco_publisher = SGLangDraftPublisher(self._speco_client(), cfg, tp_size=tp,
                                                         serialize=self.speco_serialize)
        try:
            self._speco_publisher.publish(state, version)
        except Exception as e:
            restored = self._speco_publisher.reapply()  # the previous update (-1: there was none)
            return self._speco_answer("failed", f"{type(e).__name__}: {e} (previous version {restored} re-sent)")
        if self._speco_spec is None:
            self._speco_spec = {name: tensor_spec(t) for name, t in state.items()}
        return self._speco_answer("loaded")

    def _speco_run(self, method: str, args: tuple) -> Any:
        if method == "speco_load_draft":
            return self._speco_load(str(args[0]), int(args[1]))
        if method == "speco_apply_baseline":  # the trainer refuses heldout_baseline with SGLang first
            return self._speco_answer("rejected", "SGLang reports no acceptance counters to measure a baseline with")
        if method == "speco_draft_digest":  # no SGLang route returns the draft's weights: nothing to check
            held = None if self._speco_publisher is None else self._speco_publisher.latest_version
            return {"version": -1 if held is None else int(held), "digest": None, "tensors": {}}
        if self._speco_publisher is None:
            return -1
        if method in ("speco_reapply_draft", "speco_restore_draft"):
            return int(self._speco_publisher.reapply())
        latest = self._speco_publisher.latest_version
        return -1 if latest is None else int(latest)

    async def speco_call(self, method: str, args: tuple = (), timeout: float | None = None) -> list[Any]:
        """`method` for this server's engine: one answer (node 0; the other nodes answer [])."""
        check_method(method)
        if self.node_rank != 0:
            return []
        answer = await asyncio.wait_for(asyncio.to_thread(self._speco_run, method, tuple(args)), timeout)
        return [answer]

    async def speco_spec_counters(self) -> dict[str, Any]:
        return SpecCounters().to_dict()


def speco_sglang_classes(server_base: type, replica_base: type) -> tuple[type, type]:
    """(`SpecoSGLangHttpServer`, `SpecoSGLangReplica`) over verl's SGLang server and replica classes:
    the replica launches the server class (`server_class = ray.remote(server)`, as verl's does)."""
    import ray

    server = type("SpecoSGLangHttpServer", (SGLangDraftServerMixin, server_base), {"__module__": __name__})

    base_init: Callable[..., None] = replica_base.__init__  # type: ignore[misc]

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        base_init(self, *args, **kwargs)
        self.server_class = ray.remote(server)

    replica = type("SpecoSGLangReplica", (SpecoReplicaMixin, replica_base),
                   {"__module__": __name__, "__init__": __init__})
    return server, replica


def _load_speco_sglang() -> type:
    from verl.workers.rollout.sglang_rollout.async_sglang_server import SGLangHttpServer, SGLangReplica

    return speco_sglang_classes(SGLangHttpServer, SGLangReplica)[1]


def install_sglang_replica_class() -> None:
    """Make verl's `get_rollout_replica_class("sglang")` return `SpecoSGLangReplica` in this process."""
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    RolloutReplicaRegistry.register("sglang", _load_speco_sglang)
