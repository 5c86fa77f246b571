"""Live draft publishing into a running vLLM (CPU) engine through the worker extension.

The cycle target and its oracle draft (conftest) have exactly known acceptance figures, so a swap
is visible in vLLM's own counters: random draft -> oracle (exact oracle figures) -> random again.
One engine for the whole module (vLLM keeps one metrics registry per process).
"""

from __future__ import annotations

import re
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
from .publish_faults import CORRUPTIONS

pytestmark = pytest.mark.vllm

K = 3
MAX_TOKENS = 16
PROMPTS = [[5, 9, 13, 40, 2], [7, 7, 8], list(range(10, 30))]


@pytest.fixture(scope="module")
def live(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    from verl_speco.engines import vllm_engine, vllm_reload

    root = tmp_path_factory.mktemp("publish")
    perm = single_cycle(VOCAB, seed=3)
    target = build_cycle_target(root / "target", perm)
    cfg = draft_config()
    states = {"random": random_draft(cfg, seed=2), "oracle": oracle_draft(cfg, target, perm)}
    start = export_eagle3(states["random"], cfg, root / "start")
    llm = vllm_engine.build_llm(target, start, num_speculative_tokens=K,
                                worker_extension_cls=vllm_reload.DRAFT_EXTENSION)
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


def _publish(live: dict[str, Any], name: str, version: int) -> list[dict[str, Any]]:
    from verl_speco.engines.vllm_reload import publish_draft

    pub = write_version(live["root"] / "versions", version, live["tensors"][name], bucket_bytes=64 << 10)
    assert pub.num_buckets > 1  # the receiver loads bucket by bucket
    return publish_draft(live["llm"], pub.path, pub.version)


def test_swaps_change_vllm_acceptance_exactly(live: dict[str, Any]) -> None:
    from verl_speco.engines.vllm_reload import draft_stats

    before = _run(live)
    assert before["mean_acceptance_length"] < 1.5
    assert _publish(live, "oracle", 1) == [{"status": "loaded", "version": 1, "reason": ""}]
    oracle = _run(live)
    # the oracle is right at draft position 1 only, on every round (conftest)
    assert oracle["accepted_per_pos"] == [oracle["num_drafts"], 0, 0]
    assert oracle["mean_acceptance_length"] == 2.0
    stats = draft_stats(live["llm"])[0]
    assert stats["version"] == 1 and stats["loads"] == 1
    assert _publish(live, "random", 2)[0]["status"] == "loaded"
    assert _run(live) == before  # back to the exact figures of the starting draft


def test_stale_publish_is_dropped_and_counted(live: dict[str, Any]) -> None:
    from verl_speco.engines.vllm_reload import draft_stats, publish_draft

    assert _publish(live, "oracle", 3)[0]["status"] == "loaded"
    digest = draft_stats(live["llm"])[0]["digest"]
    stale = live["root"] / "versions" / "v000002"  # the random draft, an older version
    assert publish_draft(live["llm"], stale, 2) == [{"status": "stale", "version": 3,
                                                     "reason": "version 2 <= the loaded version 3"}]
    stats = draft_stats(live["llm"])[0]
    assert stats["version"] == 3 and stats["dropped"] >= 1 and stats["digest"] == digest
    assert _run(live)["mean_acceptance_length"] == 2.0


def test_latest_draft_survives_the_target_weight_sync(live: dict[str, Any]) -> None:
    from verl_speco.engines.vllm_reload import draft_stats, reload_target

    assert _publish(live, "oracle", 4)[0]["status"] == "loaded"
    digest = draft_stats(live["llm"])[0]["digest"]
    reload_target(live["llm"], live["target"])  # the target's own in-place weight sync
    after = draft_stats(live["llm"])[0]
    assert after["version"] == 4 and after["digest"] == digest
    assert _run(live)["mean_acceptance_length"] == 2.0  # not the starting (random) draft


def test_reapply_restores_the_published_draft_after_its_memory_was_overwritten(live: dict[str, Any]) -> None:
    from verl_speco.engines.vllm_reload import draft_stats

    assert _publish(live, "oracle", 5)[0]["status"] == "loaded"
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


def test_a_baseline_serves_for_one_measurement_and_the_held_draft_returns(live: dict[str, Any]) -> None:
    """`speco_apply_baseline` serves a fixed draft (the random one) outside the version order, exactly
    (its own figures in vLLM's counters); `speco_restore_draft` brings the held version back bit for
    bit; a corrupt baseline is refused with the held draft serving."""
    from verl_speco.engines.vllm_reload import draft_stats

    assert _publish(live, "oracle", 6)[0]["status"] == "loaded"
    digest = draft_stats(live["llm"])[0]["digest"]
    base = write_version(live["root"] / "baseline", 1, live["tensors"]["random"], bucket_bytes=64 << 10)
    answer = live["llm"].collective_rpc("speco_apply_baseline", args=(str(base.path), 1))
    assert answer == [{"status": "loaded", "version": 6, "reason": ""}]  # the held version is unchanged
    baseline = _run(live)
    assert baseline["mean_acceptance_length"] < 1.5 and draft_stats(live["llm"])[0]["version"] == 6
    assert draft_stats(live["llm"])[0]["digest"] != digest
    assert live["llm"].collective_rpc("speco_restore_draft") == [6]
    assert draft_stats(live["llm"])[0]["digest"] == digest
    assert _run(live)["mean_acceptance_length"] == 2.0
    (bucket,) = sorted(base.path.glob("*.safetensors"))[:1]
    bucket.write_bytes(bucket.read_bytes()[:-8] + b"\x00" * 8)  # a corrupt baseline: refused, nothing touched
    (refusal,) = live["llm"].collective_rpc("speco_apply_baseline", args=(str(base.path), 1))
    assert refusal["status"] == "rejected" and refusal["version"] == 6
    assert draft_stats(live["llm"])[0]["digest"] == digest


def test_process_registry_counters_equal_the_engines(live: dict[str, Any]) -> None:
    """What a vLLM HTTP server reports (its process's registry) is this engine's counters."""
    from verl_speco.engines.vllm_engine import process_spec_counters, snapshot_spec_counters

    _run(live)
    assert process_spec_counters() == snapshot_spec_counters(live["llm"])
    assert process_spec_counters().num_drafts > 0


def test_publish_of_a_missing_version_is_refused_clearly(live: dict[str, Any], tmp_path: Path) -> None:
    from verl_speco.engines.vllm_reload import publish_draft

    (answer,) = publish_draft(live["llm"], tmp_path / "v000099", 99)
    assert answer["status"] == "rejected" and "no publish manifest" in answer["reason"]


# ---------------------------------------------------------------------------------------------
# Faults: a publish that is torn, wrong or tampered with never reaches the engine, and a failure
# once the reload has started puts the previous draft back. After each: generation works, greedy
# outputs equal plain decoding (the cycle continuation), and what is served is the previous version
# (its digest, and the oracle's exact acceptance figures: mean 2.0, right at position 1 only).

_VERSIONS = iter(range(100, 10_000))


def _serve_oracle(live: dict[str, Any]) -> tuple[int, str]:
    from verl_speco.engines.vllm_reload import draft_stats

    version = next(_VERSIONS)
    (answer,) = _publish(live, "oracle", version)
    assert answer == {"status": "loaded", "version": version, "reason": ""}
    return version, draft_stats(live["llm"])[0]["digest"]


def _assert_serving(live: dict[str, Any], version: int, digest: str) -> dict[str, Any]:
    from verl_speco.engines.vllm_reload import draft_stats

    stats = draft_stats(live["llm"])[0]
    assert stats["version"] == version and stats["digest"] == digest
    metrics = _run(live)  # generation works and is lossless
    assert metrics["mean_acceptance_length"] == 2.0
    assert metrics["accepted_per_pos"] == [metrics["num_drafts"], 0, 0]
    return stats


def _offer(live: dict[str, Any], path: Path, version: int) -> dict[str, Any]:
    from verl_speco.engines.vllm_reload import publish_draft

    (answer,) = publish_draft(live["llm"], path, version)
    return answer


@pytest.mark.parametrize("name", list(CORRUPTIONS))
def test_a_corrupt_publish_is_refused_before_the_engine_is_touched(live: dict[str, Any], name: str) -> None:
    corrupt, reason, message = CORRUPTIONS[name]
    good, digest = _serve_oracle(live)
    rejected_before = _assert_serving(live, good, digest)["rejected"]
    bad = next(_VERSIONS)
    pub = write_version(live["root"] / "versions", bad, live["tensors"]["random"], bucket_bytes=64 << 10)
    assert pub.num_buckets >= 3
    corrupt(pub.path)
    answer = _offer(live, pub.path, bad)
    assert answer["status"] == "rejected" and answer["version"] == good
    assert answer["reason"].startswith(f"{reason}: ") and re.search(message, answer["reason"])
    stats = _assert_serving(live, good, digest)
    assert stats["rejected"] == rejected_before + 1 and stats["last_reason"] == answer["reason"]
    assert live["llm"].collective_rpc("speco_reapply_draft") == [good]  # the previous version re-applies
    _assert_serving(live, good, digest)


def _variant(live: dict[str, Any], version: int, edit: Any) -> Path:
    state = {k: v.clone() for k, v in live["tensors"]["random"].items()}
    edit(state)
    return write_version(live["root"] / "versions", version, state, bucket_bytes=64 << 10).path


@pytest.mark.parametrize("case", ["wrong shape", "wrong dtype", "all NaN", "one inf", "missing tensor",
                                  "extra tensor", "old directory under a new version"])
def test_a_wrong_publish_is_refused_and_the_previous_draft_keeps_serving(live: dict[str, Any], case: str) -> None:
    good, digest = _serve_oracle(live)
    bad = next(_VERSIONS)
    down = "midlayer.mlp.down_proj.weight"
    if case == "wrong shape":
        path = _variant(live, bad, lambda s: s.update({down: s[down][:, :-1].contiguous()}))
        want = f"spec: .*{down}: \\(\\(64, 127\\), 'float32'\\), expected \\(\\(64, 128\\), 'float32'\\)"
    elif case == "wrong dtype":
        path = _variant(live, bad, lambda s: s.update({down: s[down].to(torch.bfloat16)}))
        want = f"spec: .*{down}: .*'bfloat16'\\), expected .*'float32'\\)"
    elif case == "all NaN":
        path = _variant(live, bad, lambda s: [t.fill_(float("nan")) for t in s.values() if t.is_floating_point()])
        want = "non_finite: .* has 4096 non-finite values of 4096|non_finite: "
    elif case == "one inf":
        path = _variant(live, bad, lambda s: s[down].view(-1).__setitem__(7, float("inf")))
        want = f"non_finite: .*{down} has 1 non-finite values"
    elif case == "missing tensor":
        path = _variant(live, bad, lambda s: s.pop("midlayer.hidden_norm.weight"))
        want = "spec: .*missing \\['midlayer.hidden_norm.weight'\\], unexpected \\[\\]"
    elif case == "extra tensor":
        path = _variant(live, bad, lambda s: s.update({"lm_head.bias": torch.zeros(VOCAB)}))
        want = "spec: .*missing \\[\\], unexpected \\['lm_head.bias'\\]"
    else:  # the directory of the version being served, offered again under a new number
        path, want = live["root"] / "versions" / f"v{good:06d}", f"version: .*offered as version {bad}"
    answer = _offer(live, path, bad)
    assert answer["status"] == "rejected" and answer["version"] == good
    assert re.search(want, answer["reason"]), answer["reason"]
    _assert_serving(live, good, digest)
    assert live["llm"].collective_rpc("speco_reapply_draft") == [good]
    _assert_serving(live, good, digest)


def test_a_failure_after_the_reload_started_restores_the_previous_draft(live: dict[str, Any]) -> None:
    """The reload is interrupted after its first bucket (vLLM's layer-wise reload has moved the
    draft's layers to meta tensors by then): the previous weights must come back, bit for bit."""
    good, digest = _serve_oracle(live)
    bad = next(_VERSIONS)
    pub = write_version(live["root"] / "versions", bad, live["tensors"]["random"], bucket_bytes=64 << 10)

    def break_second_bucket(worker: Any) -> None:
        model = worker.model_runner.drafter.model
        original, calls = model.load_weights, []

        def load_weights(weights: Any) -> Any:
            calls.append(1)
            if len(calls) == 2:
                raise OSError("planted: the disk went away mid-reload")
            return original(weights)

        model.load_weights = load_weights

    def unbreak(worker: Any) -> None:
        del worker.model_runner.drafter.model.load_weights

    live["llm"].collective_rpc(break_second_bucket)
    try:
        answer = _offer(live, pub.path, bad)
    finally:
        live["llm"].collective_rpc(unbreak)
    assert answer["status"] == "failed" and answer["version"] == good
    assert "planted: the disk went away" in answer["reason"] and f"previous version {good} restored" in answer["reason"]
    _assert_serving(live, good, digest)
    # the same (intact) version loads once the fault is gone: the engine was left able to reload
    assert _offer(live, pub.path, bad)["status"] == "loaded"
    assert _run(live)["mean_acceptance_length"] < 1.5  # the random draft is what serves now


# ---------------------------------------------------------------------------------------------
# P-EAGLE (parallel-drafting EAGLE-3): the mask-slot state vLLM derives from the weights.
# vLLM 0.32 handles `mask_hidden` outside the layer-wise loader (llama_eagle3.py: a direct copy into
# a buffer, and a ValueError for any load_weights call without it) and its proposer computes the
# hidden state of every mask slot, fc(mask_hidden), ONCE at load time (llm_base_proposer.py
# `parallel_drafting_hidden_state_tensor`). The draft reload handles both (vllm_reload.py
# `_parallel_drafting_mask`, `_load_mask_hidden`, `_refresh_parallel_drafting_hidden`).

# Settings of the trained P-EAGLE draft: 1 layer, K = 3 depths, MASK = id 95. Measured (float32,
# 120 steps on 16 greedy continuations, ~20 s): reference counters (drafts, accepted, per position)
# trained (84, 32, [19, 7, 6]), untrained (115, 0, [0, 0, 0]), trained with the untrained
# fc(mask_hidden) at the mask slots (what a stale engine drafts) (83, 35, [18, 9, 8]).
PEAGLE_SETTINGS: dict[str, Any] = {"num_layers": 1, "num_depths": 3, "mask_token_id": 95, "attn_backend": "sdpa"}


# Before the P-EAGLE test: its own in-process engine's shutdown tears down the parallel groups `live` uses.
def _served_digest(worker: Any) -> dict[str, Any]:
    from verl_speco.engines.draft_digest import DraftDigestMixin

    return DraftDigestMixin.speco_draft_digest(worker)  # what the rollout workers answer (vllm_server.py)


def test_the_served_draft_digest_is_stable_until_the_draft_is_lost(live: dict[str, Any]) -> None:
    """The trainer's wake-up check (verl_integration/served_draft.py) on a real engine: the digest of
    the draft's own tensors does not move with generation, a target sync or a re-apply of the same
    version, and does move when the draft's memory is lost; the shared embedding is not in it."""
    from verl_speco.engines.vllm_reload import reload_target

    version = next(_VERSIONS)
    assert _publish(live, "oracle", version)[0]["status"] == "loaded"
    loaded = live["llm"].collective_rpc(_served_digest)[0]
    assert loaded["version"] == version and not any("embed_tokens" in name for name in loaded["tensors"])
    _run(live)
    reload_target(live["llm"], live["target"])
    assert live["llm"].collective_rpc(_served_digest)[0] == loaded

    def lose(worker: Any) -> None:  # a level-2 wake: the draft's own memory is not reloaded
        with torch.no_grad():
            for name, p in worker.model_runner.drafter.model.named_parameters():
                if "embed_tokens" not in name:
                    p.zero_()

    live["llm"].collective_rpc(lose)
    assert live["llm"].collective_rpc(_served_digest)[0]["digest"] != loaded["digest"]
    assert live["llm"].collective_rpc("speco_reapply_draft") == [version]
    assert live["llm"].collective_rpc(_served_digest)[0] == loaded
    assert _run(live)["mean_acceptance_length"] == 2.0



def _peagle_reference(hf: Any, family: Any, model: Any, spec: Any,
                      mask_slot_hidden: torch.Tensor | None = None) -> tuple[list[list[int]], tuple[int, int, list[int]]]:
    """The reference decoder's outputs and counters on the parity prompts (conftest), K = 3; with
    `mask_slot_hidden`, the model's mask slots read that post-fc hidden state instead of
    fc(mask_hidden) (the stale engine's drafts)."""
    from drafters.common.metrics import AcceptanceStats
    from drafters.spec_decode import speculative_generate

    from .conftest import MAX_TOKENS
    from .conftest import PROMPTS as PARITY_PROMPTS
    from .conftest import K as PARITY_K

    if mask_slot_hidden is not None:
        own = model.element_inputs

        def element_inputs(input_ids: Any, aux_hidden: Any, layout: Any) -> Any:
            embeds, h = own(input_ids, aux_hidden, layout)
            return embeds, torch.where((layout.depth == 0)[..., None], h, mask_slot_hidden)

        model.element_inputs = element_inputs
    try:
        proposer = family.proposer(model, spec)
        outputs, stats = [], AcceptanceStats()
        for prompt in PARITY_PROMPTS:
            res = speculative_generate(hf, proposer, torch.tensor(prompt), num_speculative_tokens=PARITY_K,
                                       max_new_tokens=MAX_TOKENS)
            outputs.append(res.token_ids.tolist())
            stats = stats.merge(res.stats)
    finally:
        model.__dict__.pop("element_inputs", None)
    return outputs, (stats.num_drafts, stats.num_accepted, list(stats.accepted_per_pos))


def test_peagle_live_publish_recomputes_the_mask_slot_hidden_state(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine started from an UNTRAINED P-EAGLE export, then a TRAINED one published live:
    vLLM must draft exactly what the reference drafts with the trained model (greedy outputs ==
    plain decoding, acceptance counters == the reference's), whatever the bucket split.

    Before the fix: a publish of more than one bucket failed ("mask_hidden not found in weights
    but model is configured for parallel drafting", vLLM's load_weights for every bucket without
    it); one of one bucket loaded but kept the start-up mask_hidden (copied into the reload's meta
    placeholder) and the start-up fc(mask_hidden) (computed once in the proposer's load_model).
    The staleness is made visible here: with the recompute disabled (`_refresh_parallel_drafting_hidden`
    a no-op) the engine's counters are those of the trained draft with the UNTRAINED
    fc(mask_hidden) at its mask slots, not the trained draft's. A failure after the new mask
    state was written (planted in fc(mask_hidden)'s recompute) restores the previous version's
    mask state too, and a later publish of the untrained draft brings back its counters."""
    from transformers import Qwen3ForCausalLM

    from drafters.common.target import TargetHead, TargetSpec
    from drafters.registry import get_family
    from drafters.spec_decode import autoregressive_generate
    from verl_speco.engines import vllm_engine, vllm_reload

    from .conftest import MAX_TOKENS, build_normed_target, greedy_run, train_draft, vllm_counts
    from .conftest import PROMPTS as PARITY_PROMPTS
    from .conftest import K as PARITY_K

    target = build_normed_target(tmp_path / "target")
    spec, head = TargetSpec.from_pretrained(target), TargetHead.from_pretrained(target)
    hf = Qwen3ForCausalLM.from_pretrained(target).eval()
    baseline = [autoregressive_generate(hf, torch.tensor(p), MAX_TOKENS).tolist() for p in PARITY_PROMPTS]
    family = get_family("peagle")
    cfg = family.resolve(family.config_cls(**PEAGLE_SETTINGS), spec)
    trained: Any = train_draft(family, cfg, target)
    torch.manual_seed(7)
    untrained: Any = family.build(cfg, head).eval()
    with torch.no_grad():
        stale_hidden = untrained.fc(untrained.mask_hidden)[0]  # what the engine computed at start-up
        trained_hidden = trained.fc(trained.mask_hidden)[0]
    refs = {"trained": _peagle_reference(hf, family, trained, spec),
            "untrained": _peagle_reference(hf, family, untrained, spec),
            "stale": _peagle_reference(hf, family, trained, spec, mask_slot_hidden=stale_hidden)}
    print("P-EAGLE reference counters:", {k: v[1] for k, v in refs.items()})
    assert all(outputs == baseline for outputs, _ in refs.values())  # the reference decoder is lossless
    drafts, accepted, per_pos = refs["trained"][1]
    assert min(per_pos) > 0, refs["trained"]  # the trained draft accepts at the mask slots (positions 2, 3)
    assert refs["stale"][1] != refs["trained"][1]  # a stale fc(mask_hidden) changes the counters
    assert refs["untrained"][1] != refs["trained"][1]

    fmt = family.engine_format(cfg, spec)
    start = family.export(untrained, cfg, spec, tmp_path / "untrained")
    sc = fmt.vllm_speculative_config(start, PARITY_K)
    assert sc["parallel_drafting"] is True and sc["method"] == "eagle3"
    tensors = {"trained": fmt.engine_tensors(trained.state_dict()), "untrained": fmt.engine_tensors(untrained.state_dict())}
    versions = tmp_path / "versions"

    def publish(name: str, version: int, bucket_bytes: int) -> dict[str, Any]:
        pub = write_version(versions, version, tensors[name], bucket_bytes=bucket_bytes)
        (answer,) = vllm_reload.publish_draft(llm, pub.path, pub.version)
        answer["num_buckets"] = pub.num_buckets
        return answer

    def mask_state(worker: Any) -> tuple[torch.Tensor, torch.Tensor]:
        drafter = worker.model_runner.drafter
        return drafter.model.mask_hidden.detach().clone(), drafter.parallel_drafting_hidden_state_tensor.clone()

    def served() -> tuple[int, int, list[int]]:
        outputs, m = greedy_run(llm)
        assert outputs == baseline  # lossless whatever draft (and mask state) is live
        assert m["num_draft_tokens"] == PARITY_K * m["num_drafts"]
        return vllm_counts(m)

    llm = vllm_engine.build_llm(target, start, method=sc["method"], num_speculative_tokens=PARITY_K,
                                speculative_extra={"parallel_drafting": True},
                                worker_extension_cls=vllm_reload.DRAFT_EXTENSION)
    try:
        seen = {"start": served()}
        # 1. one bucket, recompute disabled: mask_hidden is the trained one (it was dropped before
        # the fix), the proposer's mask-slot state is still the start-up fc(mask_hidden)
        with monkeypatch.context() as m:
            m.setattr(vllm_reload, "_refresh_parallel_drafting_hidden", lambda drafter: None)
            answer = publish("trained", 1, 256 << 20)
        assert answer["num_buckets"] == 1 and answer["status"] == "loaded", answer
        (mask, state), = llm.collective_rpc(mask_state)
        assert torch.equal(mask, tensors["trained"]["mask_hidden"])
        torch.testing.assert_close(state, stale_hidden)
        seen["stale"] = served()
        # 2. the same weights in many buckets (most without mask_hidden), recompute on
        answer = publish("trained", 2, 16 << 10)
        assert answer["num_buckets"] > 1 and answer["status"] == "loaded", answer
        (mask, state), = llm.collective_rpc(mask_state)
        assert torch.equal(mask, tensors["trained"]["mask_hidden"])
        torch.testing.assert_close(state, trained_hidden)
        digest = vllm_reload.draft_stats(llm)[0]["digest"]
        seen["trained"] = served()

        # 3. a failure once the new mask state is in (the recompute of the untrained draft's
        # fc(mask_hidden) raises): the trained version comes back, its mask state included
        def break_recompute(worker: Any) -> None:
            model = worker.model_runner.drafter.model
            own, calls = model.combine_hidden_states, []

            def combine_hidden_states(hidden: Any) -> Any:
                calls.append(1)
                if len(calls) == 1:
                    raise RuntimeError("planted: fc(mask_hidden) failed")
                return own(hidden)

            model.combine_hidden_states = combine_hidden_states

        def unbreak(worker: Any) -> None:
            worker.model_runner.drafter.model.__dict__.pop("combine_hidden_states", None)

        llm.collective_rpc(break_recompute)
        try:
            answer = publish("untrained", 3, 16 << 10)
        finally:
            llm.collective_rpc(unbreak)
        assert answer["status"] == "failed" and answer["version"] == 2, answer
        assert "planted: fc(mask_hidden) failed" in answer["reason"] and "previous version 2 restored" in answer["reason"]
        (mask, state), = llm.collective_rpc(mask_state)
        assert torch.equal(mask, tensors["trained"]["mask_hidden"])
        torch.testing.assert_close(state, trained_hidden)
        assert vllm_reload.draft_stats(llm)[0]["digest"] == digest
        seen["restored"] = served()
        # 4. the untrained draft again, many buckets: its counters come back
        answer = publish("untrained", 4, 16 << 10)
        assert answer["status"] == "loaded", answer
        seen["untrained"] = served()
    finally:
        vllm_engine.shutdown(llm)
    print("P-EAGLE live publish, vLLM counters:", seen)
    assert seen["start"] == refs["untrained"][1]
    assert seen["stale"] == refs["stale"][1] != refs["trained"][1]  # the bug, as vLLM serves it
    assert seen["trained"] == refs["trained"][1]  # the published draft, exactly
    assert seen["restored"] == refs["trained"][1]
    assert seen["untrained"] == refs["untrained"][1]

