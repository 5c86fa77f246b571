"""vLLM 0.32's own DSpark draft class reads our `native` DSpark export as it was written.

vLLM cannot serve DSpark on CPU (docs/design/engines.md section 1.2: the V1 runner refuses `dspark`, V2 needs
Triton), so there is no engine here. `Qwen3DSparkForCausalLM` (model_executor/models/qwen3_dspark.py)
is built on CPU from a `VllmConfig` of the tiny target whose speculative config is the one
`EngineArgs.create_speculative_config` makes for our export. That config passes vLLM's own
SpeculativeConfig validation (architecture, Markov and confidence keys); only the V1-runner check
of VllmConfig is bypassed. Every vLLM parameter starts as NaN; after its `load_weights(export tensors)`:
- every exported tensor was consumed and lands, value for value, in the parameter vLLM maps it to
  (the DFlash backbone's mapping, plus the Markov and confidence heads under `model.`;
  `markov_w2` is a vocab-padded LM head: its first V rows hold ours);
- every draft parameter was loaded except the target-shared ones and `model.mask_embedding`;
- the heads were built as config.json says: rank, confidence head with the Markov input.
A gated Markov head is refused before vLLM sees it (vLLM builds only the vanilla head).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from drafters.common.target import TargetHead, TargetSpec
from drafters.dspark import DSparkConfig, DSparkDraft
from drafters.dspark.export import DSparkExportConfig

from .conftest import VOCAB, build_target
from .test_dflash_vllm_loader import OPTIONAL, SHARED, expected_backbone_params
from .vllm_loader import loaded_by_vllm

pytestmark = pytest.mark.vllm

CFG = DSparkConfig(num_layers=2, block_size=4, target_layer_ids=(1, 3, 5), num_target_features=3,
                   mask_token_id=VOCAB - 1, markov_rank=8, attn_backend="sdpa")
HEADS = ("markov_head.", "confidence_head.")


def _draft_state(spec: TargetSpec) -> dict[str, torch.Tensor]:
    head = TargetHead(spec, torch.randn(spec.vocab_size, spec.hidden_size),
                      torch.randn(spec.vocab_size, spec.hidden_size), torch.ones(spec.hidden_size))
    model = DSparkDraft(CFG, head)
    gen = torch.Generator().manual_seed(13)
    with torch.no_grad():  # distinct values everywhere: a swapped or dropped tensor shows
        for name, p in model.named_parameters():
            p.copy_(torch.rand(p.shape, generator=gen) + 0.5 if name.endswith("norm.weight")
                    else torch.randn(p.shape, generator=gen) * 0.1)
    return model.state_dict()


@pytest.fixture(scope="module")
def vllm_draft(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.models.qwen3_dspark import Qwen3DSparkForCausalLM

    root = tmp_path_factory.mktemp("dspark_vllm")
    target = build_target(root / "target", seed=6)
    spec = TargetSpec.from_pretrained(target)
    export_cfg = DSparkExportConfig.from_drafter(CFG, spec)
    draft = export_cfg.export(_draft_state(spec), root / "draft")
    common = {"model": str(target), "tokenizer": str(target), "dtype": "float32", "max_model_len": 128,
              "enforce_eager": True}
    vllm_config = EngineArgs(**common).create_engine_config()
    spec_args = EngineArgs(**common, speculative_config=export_cfg.vllm_speculative_config(draft, CFG.block_size))
    vllm_config.speculative_config = spec_args.create_speculative_config(vllm_config.model_config,
                                                                         vllm_config.parallel_config)
    with loaded_by_vllm(Qwen3DSparkForCausalLM, vllm_config, draft) as loaded:
        yield {"model": loaded.model, "tensors": loaded.tensors, "consumed": loaded.consumed,
               "vllm_config": vllm_config, "export_cfg": export_cfg, "draft": draft}


def test_every_exported_tensor_is_consumed_and_every_draft_parameter_loaded(vllm_draft: dict[str, Any]) -> None:
    model, tensors = vllm_draft["model"], vllm_draft["tensors"]
    assert sorted(vllm_draft["consumed"]) == sorted(tensors)
    params = dict(model.named_parameters())
    want = expected_backbone_params({k: v for k, v in tensors.items() if not k.startswith(HEADS)})
    want.update({"model." + k: v for k, v in tensors.items() if k.startswith(HEADS)})
    assert set(want) == set(params) - SHARED - OPTIONAL, sorted(set(want) ^ (set(params) - SHARED - OPTIONAL))
    for name, value in want.items():
        got = params[name].detach()
        if name.endswith("markov_w2.weight"):  # a ParallelLMHead: rows padded to a multiple of 64
            assert got.shape[0] >= value.shape[0] and got.shape[1:] == value.shape[1:], name
            got = got[: value.shape[0]]
        assert tuple(got.shape) == tuple(value.shape), (name, tuple(got.shape), tuple(value.shape))
        assert not bool(torch.isnan(got).any()), f"{name}: not (fully) loaded"
        assert torch.equal(got, value.to(got.dtype)), name


def test_vllm_reads_the_config_as_written(vllm_draft: dict[str, Any]) -> None:
    sc = vllm_draft["vllm_config"].speculative_config
    hf = sc.draft_model_config.hf_config
    assert sc.method == "dspark" and sc.num_speculative_tokens == CFG.block_size  # K = block_size
    assert list(hf.architectures) == ["Qwen3DSparkModel"]
    model = vllm_draft["model"]
    assert model.model.markov_head.markov_w1.weight.shape == (VOCAB, CFG.markov_rank)
    conf = model.model.confidence_head
    assert conf is not None and conf.with_markov  # vLLM's default would be False: written explicitly
    assert model.model.fc.weight.shape[1] == 3 * hf.hidden_size  # capture ids (1, 3, 5) + 1


def test_a_gated_markov_head_is_refused_for_vllm(vllm_draft: dict[str, Any]) -> None:
    import dataclasses

    gated = dataclasses.replace(vllm_draft["export_cfg"], markov_head_type="gated")
    with pytest.raises(ValueError, match="markov_head_type='gated', expected 'vanilla'"):
        gated.vllm_speculative_config(vllm_draft["draft"], CFG.block_size)
    with pytest.raises(ValueError, match="num_speculative_tokens=3, expected block_size = 4"):
        vllm_draft["export_cfg"].vllm_speculative_config(vllm_draft["draft"], 3)
