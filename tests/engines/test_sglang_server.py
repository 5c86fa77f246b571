"""The SGLang rollout server side of a verl run: published versions reach SGLang's HTTP routes.

verl's `SGLangHttpServer` imports sglang (not installable here), so `SGLangDraftServerMixin` is put
in front of a stand-in with the attributes of verl's server it reads (pinned against verl's source
in tests/verl/test_contract.py); the server it talks to is the `FakeSGLang` contract double of
test_sglang_http.py (a real local HTTP server checking SGLang's request dataclasses), and what
arrives is rebuilt from the bytes and compared bit for bit with the published tensors.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from drafters.eagle3.export import Eagle3ExportConfig, engine_tensors
from verl_speco.engines.sglang_publish import check_draft_update, publishable_tensors
from verl_speco.engines.spec_metrics import SpecCounters
from verl_speco.online.publish import write_version
from verl_speco.verl_integration.draft_servers import SGLangDraftServerMixin, speco_sglang_classes

from .test_sglang_http import UPDATE, FakeSGLang, RawBucketCodec, assert_sessions_wrap_updates, serving


class VerlServerStandIn:
    """What the mixin reads of verl's SGLangHttpServer: node_rank, config, get_server_address()."""

    def __init__(self, address: tuple[str, int], node_rank: int = 0, tp: int = 2):
        self._address = address
        self.node_rank = node_rank
        self.config = SimpleNamespace(tensor_model_parallel_size=tp)

    def get_server_address(self) -> tuple[str, int]:
        return self._address


class VerlReplicaStandIn:
    def __init__(self, servers: list[Any]):
        self.servers = servers
        self.server_class: Any = None


class LocalActor:
    """`actor.method.remote(...)` awaits the method of an in-process object (a Ray actor stand-in)."""

    def __init__(self, obj: Any):
        self._obj = obj

    def __getattr__(self, name: str) -> Any:
        return SimpleNamespace(remote=getattr(self._obj, name))


@pytest.fixture()
def sglang() -> Iterator[FakeSGLang]:
    yield from serving(FakeSGLang(api_key=None))  # verl launches SGLang without an API key


def _publish(root: Path, model: torch.nn.Module, cfg: Eagle3ExportConfig, version: int, scale: float,
             meta: bool = True) -> tuple[Path, dict[str, torch.Tensor]]:
    """A version as `DrafterSession.publish` writes it (engine names, export config in the meta)."""
    state = engine_tensors({k: v * scale if v.is_floating_point() else v for k, v in model.state_dict().items()},
                           cfg, "native")
    pub = write_version(root, version, state, bucket_bytes=64 << 10,
                        meta={"engine_format": cfg.to_dict()} if meta else {})
    return pub.path, state


def test_published_versions_reach_sglang_draft_only(draft: tuple[torch.nn.Module, Eagle3ExportConfig],
                                                     sglang: FakeSGLang, tmp_path: Path) -> None:
    model, cfg = draft
    host, port = sglang.httpd.server_address[:2]
    Server, Replica = speco_sglang_classes(VerlServerStandIn, VerlReplicaStandIn)
    assert issubclass(Server, SGLangDraftServerMixin) and issubclass(Server, VerlServerStandIn)
    server = Server((str(host), int(port)))
    server.speco_serialize = RawBucketCodec.encode
    replica = Replica([LocalActor(server)])
    assert replica.server_class is not None  # the replica launches our server class

    def call(method: str, *args: Any) -> list[Any]:
        return asyncio.run(replica.speco_call(method, args))

    assert call("speco_draft_version") == [-1] and call("speco_reapply_draft") == [-1]
    assert sglang.calls == []
    path3, state3 = _publish(tmp_path / "pub", model, cfg, 3, 1.0)
    assert call("speco_load_draft", str(path3), 3) == [{"status": "loaded", "version": 3, "reason": ""}]
    updates = [c.body for c in sglang.calls if c.route == UPDATE]
    assert updates and all(b["selector"] == "draft" for b in updates)
    assert all(len(b["serialized_named_tensors"]) == 2 for b in updates)  # tp=2: one entry per rank
    check_draft_update(sglang.tensor_updates(), cfg, tp_size=2, deserialize=RawBucketCodec.decode,
                       expected=publishable_tensors(state3, cfg))
    n = len(sglang.calls)
    (stale,) = call("speco_load_draft", str(path3), 3)
    assert stale["status"] == "stale" and stale["version"] == 3 and len(sglang.calls) == n  # nothing sent
    path4, state4 = _publish(tmp_path / "pub", model, cfg, 4, 2.0)
    assert call("speco_load_draft", str(path4), 4)[0]["status"] == "loaded" and call("speco_draft_version") == [4]
    m = len(sglang.calls)  # no SGLang route reads the draft back: no digest, the trainer re-applies unchecked
    assert call("speco_draft_digest") == [{"version": 4, "digest": None, "tensors": {}}] and len(sglang.calls) == m
    check_draft_update(sglang.tensor_updates(n), cfg, tp_size=2, deserialize=RawBucketCodec.decode,
                       expected=publishable_tensors(state4, cfg))
    n = len(sglang.calls)
    assert call("speco_reapply_draft") == [4]  # after the target's sync / a wake-up: v4 again
    check_draft_update(sglang.tensor_updates(n), cfg, tp_size=2, deserialize=RawBucketCodec.decode,
                       expected=publishable_tensors(state4, cfg))
    assert_sessions_wrap_updates(sglang.routes())
    assert asyncio.run(replica.speco_spec_counters()) == SpecCounters()  # SGLang exposes no counters

    other_node = Server((str(host), int(port)), node_rank=1)  # only node 0 serves HTTP
    assert asyncio.run(other_node.speco_call("speco_load_draft", (str(path4), 5))) == []
    with pytest.raises(ValueError, match="method 'speco_drop'"):
        call("speco_drop")
    bare, _ = _publish(tmp_path / "bare", model, cfg, 1, 1.0, meta=False)
    fresh = Server((str(host), int(port)))
    (answer,) = asyncio.run(fresh.speco_call("speco_load_draft", (str(bare), 1)))
    assert answer["status"] == "rejected" and "meta.engine_format" in answer["reason"]


def test_a_bad_publish_sends_nothing_and_a_failed_send_restores_the_previous_draft(
        draft: tuple[torch.nn.Module, Eagle3ExportConfig], sglang: FakeSGLang, tmp_path: Path) -> None:
    """The SGLang path verifies a version exactly as the vLLM worker does (`publish.verify_version`,
    against the draft SGLang started from: `engine_kwargs.sglang.speculative_draft_model_path`)
    before any request; a refusal mid-send re-sends the previous version, bit for bit."""
    from drafters.eagle3.export import export_eagle3

    from .publish_faults import CORRUPTIONS

    model, cfg = draft
    start = export_eagle3(model.state_dict(), cfg, tmp_path / "start", "native")
    host, port = sglang.httpd.server_address[:2]
    Server, _ = speco_sglang_classes(VerlServerStandIn, VerlReplicaStandIn)
    server = Server((str(host), int(port)))
    server.config.engine_kwargs = SimpleNamespace(sglang=SimpleNamespace(speculative_draft_model_path=str(start)))
    server.speco_serialize = RawBucketCodec.encode

    def load(path: Path, version: int) -> dict[str, Any]:
        (answer,) = asyncio.run(server.speco_call("speco_load_draft", (str(path), version)))
        return answer

    path3, state3 = _publish(tmp_path / "pub", model, cfg, 3, 1.0)
    assert load(path3, 3)["status"] == "loaded"
    version = 3
    down = "midlayer.mlp.down_proj.weight"
    bad: dict[str, tuple[Any, str]] = {name: (c[0], f"{c[1]}: ") for name, c in CORRUPTIONS.items()}
    for name, (corrupt, want) in bad.items():
        version += 1
        path, _ = _publish(tmp_path / "pub", model, cfg, version, 2.0)
        corrupt(path)
        calls, seen = len(sglang.calls), len(sglang.seen)
        answer = load(path, version)
        assert answer["status"] == "rejected" and answer["version"] == 3, name
        assert answer["reason"].startswith(want), (name, answer["reason"])
        assert len(sglang.calls) == calls and len(sglang.seen) == seen, f"{name}: something was sent"
    for name, edit, want in [
            ("wrong shape", lambda s: s.update({down: s[down][:, :-1].contiguous()}), f"spec: .*{down}: "),
            ("all NaN", lambda s: [t.fill_(float("nan")) for t in s.values() if t.is_floating_point()],
             "non_finite: "),
            ("missing tensor", lambda s: s.pop("midlayer.hidden_norm.weight"), "spec: .*missing")]:
        version += 1
        state = {k: v.clone() for k, v in state3.items()}
        edit(state)
        path = write_version(tmp_path / "pub", version, state, bucket_bytes=64 << 10,
                             meta={"engine_format": cfg.to_dict()}).path
        seen = len(sglang.seen)
        answer = load(path, version)
        assert answer["status"] == "rejected" and re.search(want, answer["reason"]), (name, answer)
        assert len(sglang.seen) == seen, f"{name}: something was sent"
    version += 1
    answer = load(path, version)  # an older version's directory offered under a new number
    assert answer["status"] == "rejected" and answer["reason"].startswith("version: ")

    version += 1
    path, _ = _publish(tmp_path / "pub", model, cfg, version, 3.0)
    sglang.inject[(UPDATE, sum(1 for r in sglang.seen if r == UPDATE) + 1)] = (
        400, json.dumps({"success": False, "message": "planted: out of memory"}).encode())
    n = len(sglang.calls)
    answer = load(path, version)
    assert answer["status"] == "failed" and answer["version"] == 3
    assert "planted: out of memory" in answer["reason"] and "previous version 3 re-sent" in answer["reason"]
    resent = [i for i, c in enumerate(sglang.calls[n:]) if c.route == "/begin_weight_update"][-1]
    check_draft_update(sglang.tensor_updates(n + resent), cfg, tp_size=2,
                       deserialize=RawBucketCodec.decode, expected=publishable_tensors(state3, cfg))
    assert asyncio.run(server.speco_call("speco_draft_version", ())) == [3]
