"""vLLM drafts on every step of a batch up to the last token: the engine context
(`vllm_engine.context_length`) leaves room for the drafter.

vLLM 0.32 skips its drafter for the WHOLE batch on a step whose longest sequence leaves no room for
k more draft queries within `max_model_len` (`GPUModelRunner._input_fits_in_drafter`), and then
verifies and counts k drafts of token id 0 for every request. Here the cycle target and a draft that
is right at the first draft position exactly when the token before the last one is in GOOD
(conftest's oracle with the other rows of its head zeroed; later positions are always wrong): the
requests advance at different speeds, so the longest-prompt request reaches its last tokens while
the others still run. Through the benchmark's side-by-side path (benchmarks/vllm_side_by_side.py),
vLLM's counters equal the reference decoder's (`drafters.spec_decode`), and so do those of
`evaluation.vllm_acceptance`; a planted fault, the context the benchmark used before (longest prompt
+ max_new_tokens + k + 1), makes vLLM count rounds of token-0 drafts that the reference decoder does
not have.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from drafters.eagle3.export import export_eagle3

from .conftest import EOS_ID, VOCAB, build_cycle_target, draft_config, oracle_draft, single_cycle

K, MAX_TOKENS = 3, 16
PROMPTS = [list(range(7, 15)), [5, 9, 37], [7, 7, 8, 38], [44, 12, 39]]  # the first is the longest
GOOD = set(range(0, VOCAB, 2))  # second-to-last tokens after which the draft's first token is right


def test_context_length_worked_example() -> None:
    from verl_speco.engines.vllm_engine import context_length

    assert context_length(131, 64, 3) == 201
    assert context_length(10, 16, 0) == 26  # plain decoding: prompt + new tokens
    with pytest.raises(ValueError, match="longest_prompt"):
        context_length(0, 16, 3)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from drafters.common.target import TargetHead
    from verl_speco.evaluation import EvalPrompts, engine_format_of, reference_acceptance

    root = tmp_path_factory.mktemp("drafter_context")
    perm = single_cycle(VOCAB, seed=3)
    target = build_cycle_target(root / "target", perm)
    cfg = draft_config()
    sd = oracle_draft(cfg, target, perm)
    for x in set(range(VOCAB)) - GOOD:  # the draft's head row for perm(perm(x)) answers x only
        sd["lm_head.weight"][perm[perm[x]]] = 0.0
    export = export_eagle3(sd, cfg, root / "draft")
    spec = engine_format_of(export, TargetHead.from_pretrained(target)).vllm_speculative_config(export, K)
    ref = reference_acceptance(target, export, EvalPrompts(PROMPTS, EOS_ID), K, MAX_TOKENS)
    return {"target": target, "export": export, "spec": spec, "ref": ref}


def _counts(m: dict[str, Any]) -> tuple[int, int, list[int]]:
    return m["num_drafts"], m["num_accepted_tokens"], list(m["accepted_per_pos"])


def _side_by_side(served: dict[str, Any]) -> dict[str, Any]:
    from benchmarks.vllm_side_by_side import side_by_side

    res = side_by_side(Path(served["target"]), {"eagle3": (served["export"], served["spec"])}, PROMPTS,
                       eos=EOS_ID, k=K, max_new_tokens=MAX_TOKENS)
    assert res["eagle3"]["lossless"]
    eagle3: dict[str, Any] = res["eagle3"]
    return eagle3


@pytest.mark.vllm
def test_side_by_side_counters_equal_the_reference_to_the_last_step(served: dict[str, Any],
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from verl_speco.engines import vllm_engine

    ref = _counts(served["ref"])
    # the draft is right on some rounds, wrong on others: the requests drift apart
    assert 0 < ref[1] < ref[0] and ref[2][1:] == [0] * (K - 1)
    assert _counts(_side_by_side(served)) == ref
    # planted fault: the context the benchmark sized before (enough for the target, not the drafter)
    monkeypatch.setattr(vllm_engine, "context_length", lambda p, m, k: p + m + k + 1)
    faulty = _counts(_side_by_side(served))
    print(f"reference {ref}, vLLM with the drafter's context = reference, with the old context {faulty}")
    assert faulty[1] < ref[1] and faulty != ref  # rounds of token-0 drafts, counted and rejected


@pytest.mark.vllm
def test_vllm_acceptance_counters_equal_the_reference(served: dict[str, Any]) -> None:
    """The benchmark's other vLLM path (`evaluation.vllm_acceptance`) sizes its engines the same way. Its
    progress moves once per prompt each real engine answers (vLLM's `use_tqdm` hook, issue 51), and its
    generated tokens per target forward equal the reference decoder's."""
    from verl_speco.evaluation import EvalPrompts, vllm_acceptance, vllm_engine_runs

    ticks: list[int] = []
    res = vllm_acceptance(served["target"], {"eagle3": served["export"]}, EvalPrompts(PROMPTS, EOS_ID), K,
                          MAX_TOKENS, tick=lambda: ticks.append(1))["eagle3"]
    assert res["lossless"] and _counts(res) == _counts(served["ref"])
    assert len(ticks) == vllm_engine_runs(1) * len(PROMPTS)
    assert res["tokens_per_target_forward"] == pytest.approx(served["ref"]["tokens_per_target_forward"])
