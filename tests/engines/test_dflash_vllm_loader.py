"""vLLM 0.32's own DFlash draft class reads our `native` DFlash export as it was written.

No engine: `DFlashQwen3ForCausalLM` (model_executor/models/qwen3_dflash.py) is built on CPU from the
`VllmConfig` that `EngineArgs` makes for a tiny random Qwen3 target + the export (the same config
an `LLM` would get), inside `set_current_vllm_config` and a one-process gloo group. Every vLLM
parameter starts as NaN; after its `load_weights(export tensors)`:
- every exported tensor was consumed (the loader raises on unknown names, except `*.bias`, which
  our exports never carry) and lands, value for value, in the parameter vLLM maps it to
  (q/k/v -> `qkv_proj`, gate/up -> `gate_up_proj`, everything else `model.<name>`);
- every draft parameter was loaded (no NaN left), except the ones vLLM shares from the target
  (`model.embed_tokens`, `lm_head`) and `model.mask_embedding` (used only with a
  `mask_embedding.pt` file, which our exports never ship);
- vLLM read config.json as meant: capture ids = output-of-layer ids + 1 on both runners' paths,
  fc width = 3 x hidden, mask id from dflash_config, every layer non-causal.
Draft-token parity with the reference proposer: tests/engines/test_family_vllm_parity.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from drafters.common.target import TargetHead, TargetSpec
from drafters.dflash import DFlashConfig, DFlashDraft
from drafters.dflash.export import DFlashExportConfig, export_dflash

from .conftest import VOCAB, build_target
from .vllm_loader import loaded_by_vllm

pytestmark = pytest.mark.vllm

CFG = DFlashConfig(num_layers=2, block_size=4, target_layer_ids=(1, 3, 5), num_target_features=3,
                   mask_token_id=VOCAB - 1, attn_backend="sdpa")
SHARED = {"model.embed_tokens.weight", "lm_head.weight"}  # vLLM gives the draft the target's
OPTIONAL = {"model.mask_embedding"}  # loaded only from a mask_embedding.pt file (never in our exports)


def _draft_state(spec: TargetSpec) -> dict[str, torch.Tensor]:
    head = TargetHead(spec, torch.randn(spec.vocab_size, spec.hidden_size),
                      torch.randn(spec.vocab_size, spec.hidden_size), torch.ones(spec.hidden_size))
    model = DFlashDraft(CFG, head)
    gen = torch.Generator().manual_seed(11)
    with torch.no_grad():  # distinct values everywhere: a swapped or dropped tensor shows
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return model.state_dict()


@pytest.fixture(scope="module")
def vllm_draft(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.models.qwen3_dflash import DFlashQwen3ForCausalLM

    root = tmp_path_factory.mktemp("dflash_vllm")
    target = build_target(root / "target", seed=5)
    spec = TargetSpec.from_pretrained(target)
    export_cfg = DFlashExportConfig.from_drafter(CFG, spec)
    draft = export_dflash(_draft_state(spec), export_cfg, root / "draft")
    args = EngineArgs(model=str(target), tokenizer=str(target), dtype="float32", max_model_len=128,
                      enforce_eager=True,
                      speculative_config=export_cfg.vllm_speculative_config(draft, CFG.block_size - 1))
    vllm_config = args.create_engine_config()
    with loaded_by_vllm(DFlashQwen3ForCausalLM, vllm_config, draft) as loaded:
        yield {"model": loaded.model, "tensors": loaded.tensors, "consumed": loaded.consumed,
               "vllm_config": vllm_config, "spec": spec}


def expected_backbone_params(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """vLLM parameter name -> the value it must hold after loading the export."""
    out: dict[str, torch.Tensor] = {}
    stacked = {"self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
               "mlp.gate_proj.weight", "mlp.up_proj.weight"}
    for name, t in tensors.items():
        if not any(name.endswith(s) for s in stacked):
            out["model." + name] = t
    layers = sorted({int(n.split(".")[1]) for n in tensors if n.startswith("layers.")})
    for i in layers:
        p = f"layers.{i}."
        out[f"model.{p}self_attn.qkv_proj.weight"] = torch.cat(
            [tensors[p + f"self_attn.{x}_proj.weight"] for x in "qkv"], dim=0)
        out[f"model.{p}mlp.gate_up_proj.weight"] = torch.cat(
            [tensors[p + "mlp.gate_proj.weight"], tensors[p + "mlp.up_proj.weight"]], dim=0)
    return out


def test_every_exported_tensor_is_consumed_and_every_draft_parameter_loaded(vllm_draft: dict[str, Any]) -> None:
    model, tensors = vllm_draft["model"], vllm_draft["tensors"]
    assert sorted(vllm_draft["consumed"]) == sorted(tensors)  # no unknown name raised, all read
    params = dict(model.named_parameters())
    want = expected_backbone_params(tensors)
    assert set(want) == set(params) - SHARED - OPTIONAL, (sorted(set(want) ^ (set(params) - SHARED - OPTIONAL)))
    for name, value in want.items():
        got = params[name].detach()
        assert tuple(got.shape) == tuple(value.shape), (name, tuple(got.shape), tuple(value.shape))
        assert not bool(torch.isnan(got).any()), f"{name}: not (fully) loaded"
        assert torch.equal(got, value.to(got.dtype)), name
    assert not model.model.has_separate_mask_embedding  # no mask_embedding.pt: MASK = embed[mask_token_id]


def test_vllm_reads_the_config_as_exported(vllm_draft: dict[str, Any]) -> None:
    from vllm.v1.worker.gpu.spec_decode.eagle.eagle3_utils import get_eagle3_aux_layers_from_config
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    model, spec_config = vllm_draft["model"], vllm_draft["vllm_config"].speculative_config
    capture = (2, 4, 6)  # output-of-layer (1, 3, 5) + 1
    assert tuple(get_eagle3_aux_layers_from_config(spec_config) or ()) == capture  # V2 / fc width path
    v1 = GPUModelRunner._get_eagle3_aux_layers_from_config(SimpleNamespace(speculative_config=spec_config))
    assert tuple(v1 or ()) == capture  # what the V1 runner captures (an eagle_config would override it)
    hidden = vllm_draft["spec"].hidden_size
    assert model.model.fc.input_size == 3 * hidden and model.model.use_aux_hidden_state
    assert model.model.mask_token_id == VOCAB - 1
    assert model.get_draft_attn_causal() == [False, False]  # non-causal within the block
    assert spec_config.num_speculative_tokens == CFG.block_size - 1
