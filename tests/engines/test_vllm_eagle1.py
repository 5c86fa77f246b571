"""Real vLLM (CPU, `method="eagle"`) serving our EAGLE-1 export: lossless, and drafting exactly
what our reference proposer drafts (per-position acceptance counters equal, float32).

Target: a random, non-degenerate 8-layer Qwen3 (real attention and MLP) whose every RMSNorm weight
is non-unit, so a pre-norm / post-norm feature mix-up changes the drafts. Draft: an EAGLE-1 model
trained for a few seconds on the target's own greedy continuations (acceptance well above zero,
so equal counters mean something). Negative controls: the same draft with its fc halves swapped
([feature; embedding] order) in the reference, and a non-zero fc.bias that vLLM silently drops.
Three engine starts; each test reads its engine's metrics before the next starts.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from drafters.common.metrics import AcceptanceStats
from drafters.common.target import TargetHead, TargetSpec
from drafters.eagle1 import FAMILY, Eagle1Config, Eagle1Model
from drafters.eagle1.export import check_export
from drafters.spec_decode import speculative_generate

from .conftest import (
    MAX_TOKENS,
    PROMPTS,
    K,
    build_normed_target,
    engine,
    greedy_run,
    train_draft,
    vllm_counts,
)

pytestmark = pytest.mark.vllm
EAGLE = {"method": "eagle"}  # vLLM's EAGLE-1 method, K = conftest.K


def _train_draft(target_dir: Path, steps: int = 120) -> Eagle1Model:
    model = train_draft(FAMILY, Eagle1Config(feature_noise=0.0, attn_backend="sdpa"), target_dir, steps)
    assert isinstance(model, Eagle1Model)
    return model


def _reference(target_dir: Path, model: Eagle1Model) -> tuple[list[list[int]], AcceptanceStats]:
    from transformers import Qwen3ForCausalLM

    hf = Qwen3ForCausalLM.from_pretrained(target_dir).eval()
    proposer = FAMILY.proposer(model, TargetSpec.from_pretrained(target_dir))
    outputs, stats = [], AcceptanceStats()
    for prompt in PROMPTS:
        res = speculative_generate(hf, proposer, torch.tensor(prompt), num_speculative_tokens=K,
                                   max_new_tokens=MAX_TOKENS)
        outputs.append(res.token_ids.tolist())
        stats = stats.merge(res.stats)
    return outputs, stats


def _counts(s: AcceptanceStats) -> tuple[int, int, list[int]]:
    return s.num_drafts, s.num_accepted, s.accepted_per_pos


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("eagle1")
    target = build_normed_target(root / "target")
    model = _train_draft(target)
    draft = FAMILY.export(model, model.cfg, TargetSpec.from_pretrained(target), root / "draft")
    check_export(draft)
    with engine(target, spec=EAGLE) as llm:
        baseline, plain = greedy_run(llm)
    assert plain["num_drafts"] == 0
    return {"root": root, "target": target, "model": model, "draft": draft, "baseline": baseline}


def _clone(model: Eagle1Model) -> Eagle1Model:
    head = TargetHead(model.spec, model.embed_tokens.weight.detach().clone(), model.target_lm_head.clone(),
                      torch.ones(model.spec.hidden_size))
    clone = FAMILY.build(model.cfg, head)
    clone.load_state_dict(model.state_dict())
    return clone.eval()


def _swapped_fc(model: Eagle1Model) -> Eagle1Model:
    """The same weights read as fc(cat[feature; embedding]): the wrong concatenation order."""
    clone, h = _clone(model), model.spec.hidden_size
    with torch.no_grad():
        clone.fc.weight.copy_(torch.cat([model.fc.weight[:, h:], model.fc.weight[:, :h]], dim=1))
    return clone


def _with_fc_bias(model: Eagle1Model, bias: torch.Tensor) -> Eagle1Model:
    """fc(x) + bias: what SGLang computes from an export whose fc.bias is `bias`."""
    clone = _clone(model)
    clone.fc.register_forward_hook(lambda _m, _inp, out: out + bias)
    return clone


def test_vllm_serves_the_export_losslessly_with_our_drafts(setup: dict[str, Any]) -> None:
    with engine(setup["target"], setup["draft"], spec=EAGLE) as llm:
        outputs, m = greedy_run(llm)
    assert outputs == setup["baseline"]  # greedy speculative decoding is lossless
    ref_outputs, ref = _reference(setup["target"], setup["model"])
    assert ref_outputs == setup["baseline"]  # the reference decoder (HF target) is lossless too
    print(f"vLLM {vllm_counts(m)} reference {_counts(ref)}")
    assert m["num_draft_tokens"] == K * m["num_drafts"]
    # an informative draft (every position accepts sometimes): equal counters mean something
    assert ref.num_accepted > 0.05 * ref.num_draft_tokens and min(ref.accepted_per_pos) > 0  # chance: ~1/96
    assert vllm_counts(m) == _counts(ref)  # same drafts position by position (float32: exact)
    # Negative control 1: the [feature; embedding] order in the reference breaks the agreement.
    _, swapped = _reference(setup["target"], _swapped_fc(setup["model"]))
    print(f"swapped fc reference {_counts(swapped)}")
    assert _counts(swapped) != vllm_counts(m)
    setup["vllm_counts"] = vllm_counts(m)


def test_vllm_drops_a_non_zero_fc_bias_that_our_check_refuses(setup: dict[str, Any]) -> None:
    from safetensors.torch import load_file, save_file

    model: Eagle1Model = setup["model"]
    biased = setup["root"] / "biased"
    FAMILY.export(model, model.cfg, model.spec, biased)
    tensors = load_file(str(biased / "model.safetensors"))
    bias = 0.5 * torch.randn(model.spec.hidden_size, generator=torch.Generator().manual_seed(5))
    tensors["fc.bias"] = bias
    save_file(tensors, str(biased / "model.safetensors"))
    with pytest.raises(ValueError, match="'fc.bias' is not zero"):
        check_export(biased)
    with engine(setup["target"], biased, spec=EAGLE) as llm:  # bypassing our check: vLLM loads it anyway
        outputs, m = greedy_run(llm)
    assert outputs == setup["baseline"]
    assert vllm_counts(m) == setup.get("vllm_counts", vllm_counts(m))  # the bias changed nothing in vLLM
    _, ref = _reference(setup["target"], model)
    assert vllm_counts(m) == _counts(ref)  # vLLM drafts as if fc.bias were 0 ...
    _, with_bias = _reference(setup["target"], _with_fc_bias(model, bias))
    print(f"vLLM with fc.bias {vllm_counts(m)}; reference with the bias {_counts(with_bias)}")
    assert _counts(with_bias) != vllm_counts(m)  # ... so a draft trained with a bias is not what vLLM serves
