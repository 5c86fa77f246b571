"""Real vLLM (CPU) serving our EAGLE-3 exports: lossless, counted, and exactly as informative as built.

Five engine starts in all. vLLM keeps one metrics registry per process (a new engine unregisters
the previous one's counters), so every test reads its engine's metrics before the next starts.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch

from drafters.common.contract import StoreStats
from drafters.common.metrics import AcceptanceStats
from drafters.common.target import TargetHead, TargetSpec
from drafters.eagle3 import FAMILY, Eagle3Config
from drafters.eagle3.export import export_eagle3
from drafters.spec_decode import speculative_generate

from .conftest import (
    AUX_IDS,
    VOCAB,
    build_cycle_target,
    cycle_continuation,
    draft_config,
    oracle_draft,
    random_draft,
    single_cycle,
)

pytestmark = pytest.mark.vllm

K = 3  # num_speculative_tokens
MAX_TOKENS = 16
PROMPTS = [[5, 9, 13, 40, 2], [7, 7, 8], list(range(10, 30))]


@contextmanager
def engine(target: Path, draft: Path | None = None, **kw: Any) -> Iterator[Any]:
    from verl_speco.engines import vllm_engine

    llm = vllm_engine.build_llm(target, draft, num_speculative_tokens=K, **kw)
    try:
        yield llm
    finally:
        vllm_engine.shutdown(llm)


def _run(llm: Any) -> tuple[list[list[int]], dict[str, Any]]:
    from verl_speco.engines.vllm_engine import generate_with_metrics

    return generate_with_metrics(llm, PROMPTS, MAX_TOKENS)


def test_eagle3_native_is_lossless_and_counted_per_run(target_dir: Path, tmp_path: Path) -> None:
    from verl_speco.engines.vllm_engine import read_spec_metrics

    with engine(target_dir) as llm:
        baseline, plain = _run(llm)
    assert plain["num_drafts"] == 0
    kept = list(range(0, VOCAB, 3))  # reduced draft vocab: d2t offsets are exercised
    cfg = draft_config(draft_vocab_size=len(kept))
    draft = export_eagle3(random_draft(cfg, seed=1, kept=kept), cfg, tmp_path / "draft")
    with engine(target_dir, draft) as llm:
        first, m1 = _run(llm)
        second, m2 = _run(llm)
        total = read_spec_metrics(llm)
    assert first == baseline and second == baseline  # greedy speculative decoding is lossless
    assert m1["num_drafts"] > 0 and m1["num_draft_tokens"] == K * m1["num_drafts"]
    assert m2 == m1  # each call's own figures, not the running totals
    assert total["num_drafts"] == 2 * m1["num_drafts"]
    assert total["num_accepted_tokens"] == 2 * m1["num_accepted_tokens"]


@pytest.fixture(scope="module")
def cycle(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Cycle target, oracle weights, and a draft vocab holding every token the oracle must propose."""
    root = tmp_path_factory.mktemp("cycle")
    perm = single_cycle(VOCAB, seed=3)
    target = build_cycle_target(root / "target", perm)
    needed = {perm[perm[x]] for p in PROMPTS for x in [p[-1], *cycle_continuation(perm, p[-1], MAX_TOKENS)]}
    kept = sorted(needed | {0, 1})
    want = [cycle_continuation(perm, p[-1], MAX_TOKENS) for p in PROMPTS]
    cfg = draft_config(draft_vocab_size=len(kept))
    oracle = oracle_draft(draft_config(), target, perm)  # full-vocab oracle; rows cut to `kept` below
    oracle["lm_head.weight"] = oracle["lm_head.weight"][kept]
    oracle["d2t"] = torch.tensor(kept) - torch.arange(len(kept))
    oracle["t2d"] = torch.zeros(VOCAB, dtype=torch.bool)
    oracle["t2d"][kept] = True
    return {"perm": perm, "target": target, "kept": kept, "want": want, "cfg": cfg, "oracle": oracle, "root": root}


def _exact_oracle_figures(m: dict[str, Any]) -> None:
    # Draft step 1 pairs the aux features of x_t with the token x_{t+1} and predicts x_{t+2}: always
    # right here. Steps 2..K feed back the pre-norm hidden, which repeats step 1's token: always wrong.
    assert m["num_drafts"] > 0
    assert m["accepted_per_pos"] == [m["num_drafts"], 0, 0]
    assert m["mean_acceptance_length"] == 2.0 and m["per_position_acceptance_rate"] == [1.0, 0.0, 0.0]


def test_oracle_through_the_drafters_model_matches_the_reference_decoder(cycle: dict[str, Any]) -> None:
    from transformers import Qwen3ForCausalLM

    target_dir: Path = cycle["target"]
    spec, head = TargetSpec.from_pretrained(target_dir), TargetHead.from_pretrained(target_dir)
    counts = torch.zeros(VOCAB, dtype=torch.int64)
    counts[cycle["kept"]] = 1
    cfg = Eagle3Config(draft_vocab_size=len(cycle["kept"]), aux_layer_ids=AUX_IDS)
    model = FAMILY.build(cfg, head, StoreStats(token_counts=counts))
    weights = {k: v for k, v in cycle["oracle"].items() if k != "embed_tokens.weight"}
    assert sorted(model.load_state_dict(weights, strict=False).missing_keys) == ["embed_tokens.weight"]
    draft = FAMILY.export(model, cfg, spec, cycle["root"] / "family_native")
    with engine(target_dir, draft) as llm:
        outputs, m = _run(llm)
    assert outputs == cycle["want"]
    _exact_oracle_figures(m)
    # The reference decoder (pure torch) counts the same rounds and acceptances as vLLM.
    hf_target = Qwen3ForCausalLM.from_pretrained(target_dir).eval()
    stats = AcceptanceStats()
    for prompt, want in zip(PROMPTS, cycle["want"]):
        res = speculative_generate(hf_target, FAMILY.proposer(model, spec), torch.tensor(prompt),
                                   num_speculative_tokens=K, max_new_tokens=MAX_TOKENS)
        assert res.token_ids.tolist() == want
        stats = stats.merge(res.stats)
    assert (stats.num_drafts, stats.num_accepted, stats.accepted_per_pos) == (
        m["num_drafts"], m["num_accepted_tokens"], m["accepted_per_pos"])


def test_speculators_export_serves_by_directory(cycle: dict[str, Any]) -> None:
    target_dir: Path = cycle["target"]
    draft = export_eagle3(cycle["oracle"], cycle["cfg"], cycle["root"] / "spec", fmt="speculators",
                          verifier=str(target_dir), speculative_tokens=K,
                          verifier_architectures=["Qwen3ForCausalLM"])
    # `vllm serve <dir>`: the speculators config names the target (verifier) and the method.
    with engine(draft, None) as llm:
        outputs, m = _run(llm)
    assert outputs == cycle["want"]
    _exact_oracle_figures(m)


def test_random_draft_is_lossless_but_accepts_less_than_the_oracle(cycle: dict[str, Any]) -> None:
    cfg = draft_config()
    # Speculators layout with no verifier recorded: still loads through an explicit speculative_config.
    draft = export_eagle3(random_draft(cfg, seed=2), cfg, cycle["root"] / "random", fmt="speculators")
    with engine(cycle["target"], draft) as llm:
        outputs, m = _run(llm)
    assert outputs == cycle["want"]
    assert m["num_drafts"] > 0 and m["mean_acceptance_length"] < 1.5  # the oracle's is exactly 2.0
