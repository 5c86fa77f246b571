"""Live draft publishing into a running vLLM (CPU) engine through the worker extension.

The cycle target and its oracle draft (conftest) have exactly known acceptance figures, so a swap
is visible in vLLM's own counters: random draft -> oracle (exact oracle figures) -> random again.
One engine for the whole module (vLLM keeps one metrics registry per process).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from drafters.eagle3.export import engine_tensors, export_eagle3
from verl_speco.online.publish import write_version

from .conftest import (
    VOCAB,
    build_cycle_target,
    cycle_continuation,
    draft_config,
    oracle_draft,
    random_draft,
    single_cycle,
)

pytestmark = pytest.mark.vllm

K = 3
MAX_TOKENS = 16
PROMPTS = [[5, 9, 13, 40, 2], [7, 7, 8], list(range(10, 30))]


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    from verl_speco.engines import vllm_engine

    root = tmp_path_factory.mktemp("publish")
    perm = single_cycle(VOCAB, seed=3)
    target = build_cycle_target(root / "target", perm)
    cfg = draft_config()
    states = {"random": random_draft(cfg, seed=2), "oracle": oracle_draft(cfg, target, perm)}
    start = export_eagle3(states["random"], cfg, root / "start")
    llm = vllm_engine.build_llm(target, start, num_speculative_tokens=K,
                                worker_extension_cls=vllm_engine.DRAFT_EXTENSION)
    want = [cycle_continuation(perm, p[-1], MAX_TOKENS) for p in PROMPTS]
    tensors = {name: engine_tensors(sd, cfg) for name, sd in states.items()}
    try:
        yield {"llm": llm, "root": root, "target": target, "want": want, "tensors": tensors}
    finally:
        vllm_engine.shutdown(llm)


def _run(live: dict[str, Any]) -> dict[str, Any]:
    from verl_speco.engines.vllm_engine import generate_with_metrics

    outputs, metrics = generate_with_metrics(live["llm"], PROMPTS, MAX_TOKENS)
    assert outputs == live["want"]  # lossless whatever draft is live
    return metrics


def _publish(live: dict[str, Any], name: str, version: int) -> bool:
    from verl_speco.engines.vllm_engine import publish_draft

    pub = write_version(live["root"] / "versions", version, live["tensors"][name], bucket_bytes=64 << 10)
    assert pub.num_buckets > 1  # the receiver loads bucket by bucket
    return publish_draft(live["llm"], pub.path, pub.version)


def test_swaps_change_vllm_acceptance_exactly(live: dict[str, Any]) -> None:
    from verl_speco.engines.vllm_engine import draft_stats

    before = _run(live)
    assert before["mean_acceptance_length"] < 1.5
    assert _publish(live, "oracle", 1)
    oracle = _run(live)
    # the oracle is right at draft position 1 only, on every round (conftest)
    assert oracle["accepted_per_pos"] == [oracle["num_drafts"], 0, 0]
    assert oracle["mean_acceptance_length"] == 2.0
    stats = draft_stats(live["llm"])[0]
    assert stats["version"] == 1 and stats["loads"] == 1
    assert _publish(live, "random", 2)
    assert _run(live) == before  # back to the exact figures of the starting draft


def test_stale_publish_is_dropped_and_counted(live: dict[str, Any]) -> None:
    from verl_speco.engines.vllm_engine import draft_stats, publish_draft

    assert _publish(live, "oracle", 3)
    digest = draft_stats(live["llm"])[0]["digest"]
    stale = live["root"] / "versions" / "v000002"  # the random draft, an older version
    assert not publish_draft(live["llm"], stale, 2)
    stats = draft_stats(live["llm"])[0]
    assert stats["version"] == 3 and stats["dropped"] >= 1 and stats["digest"] == digest
    assert _run(live)["mean_acceptance_length"] == 2.0


def test_latest_draft_survives_the_target_weight_sync(live: dict[str, Any]) -> None:
    from verl_speco.engines.vllm_engine import draft_stats, reload_target

    assert _publish(live, "oracle", 4)
    digest = draft_stats(live["llm"])[0]["digest"]
    reload_target(live["llm"], live["target"])  # the target's own in-place weight sync
    after = draft_stats(live["llm"])[0]
    assert after["version"] == 4 and after["digest"] == digest
    assert _run(live)["mean_acceptance_length"] == 2.0  # not the starting (random) draft


def test_reapply_restores_the_published_draft_after_its_memory_was_overwritten(live: dict[str, Any]) -> None:
    from verl_speco.engines.vllm_engine import draft_stats

    assert _publish(live, "oracle", 5)
    digest = draft_stats(live["llm"])[0]["digest"]

    def clobber(worker: Any) -> None:  # what a sleep that discards weights leaves behind
        with torch.no_grad():
            for name, p in worker.model_runner.drafter.model.named_parameters():
                if "embed_tokens" not in name:  # shared with the target, restored by its own sync
                    p.zero_()

    live["llm"].collective_rpc(clobber)
    assert draft_stats(live["llm"])[0]["digest"] != digest
    assert live["llm"].collective_rpc("speco_reapply_draft") == [5]
    assert draft_stats(live["llm"])[0]["digest"] == digest
    assert _run(live)["mean_acceptance_length"] == 2.0


def test_process_registry_counters_equal_the_engines(live: dict[str, Any]) -> None:
    """What a vLLM HTTP server reports (its process's registry) is this engine's counters."""
    from verl_speco.engines.vllm_engine import process_spec_counters, snapshot_spec_counters

    _run(live)
    assert process_spec_counters() == snapshot_spec_counters(live["llm"])
    assert process_spec_counters().num_drafts > 0


def test_publish_of_a_missing_version_fails_clearly(live: dict[str, Any], tmp_path: Path) -> None:
    from verl_speco.engines.vllm_engine import publish_draft

    with pytest.raises(Exception, match="manifest"):
        publish_draft(live["llm"], tmp_path / "nothing", 99)
