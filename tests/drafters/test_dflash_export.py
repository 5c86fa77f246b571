"""DFlash export: exact config.json (golden), exact tensor names, a bit-exact export -> check -> load
round trip, our check refusing every planted fault (naming it) before an engine sees it, the K rule
of the speculative arguments and the engine-format dict round trip."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from drafter_targets import tiny_spec
from safetensors.torch import load_file, save_file

from drafters.common.target import TargetHead
from drafters.dflash import FAMILY, DFlashConfig, DFlashDraft
from drafters.dflash.export import (
    META_FILE,
    DFlashExportConfig,
    check_export,
    engine_tensors,
    export,
)

SPEC = tiny_spec(vocab=32, hidden=16, layers=8, heads=4, kv_heads=2)  # head_dim 4, intermediate 32
CFG = DFlashConfig(num_layers=2, block_size=4, target_layer_ids=(1, 3, 5), num_target_features=3,
                   mask_token_id=31, loss_gamma=2.5, num_anchors=7, attn_backend="sdpa")
LAYER_NAMES = ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
               "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
               "self_attn.q_norm.weight", "self_attn.k_norm.weight", "mlp.gate_proj.weight",
               "mlp.up_proj.weight", "mlp.down_proj.weight")
ENGINE_NAMES = {"fc.weight", "hidden_norm.weight", "norm.weight",
                *(f"layers.{i}.{n}" for i in range(2) for n in LAYER_NAMES)}


def _head(seed: int = 0) -> TargetHead:
    gen = torch.Generator().manual_seed(seed)
    return TargetHead(SPEC, torch.randn(32, 16, generator=gen), torch.randn(32, 16, generator=gen),
                      torch.rand(16, generator=gen) + 0.5)


def _model(seed: int = 3) -> DFlashDraft:
    """Random non-degenerate weights: every norm in U[0.5, 1.5) (a dropped or re-initialised tensor shows)."""
    model = DFlashDraft(CFG, _head())
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return model


@pytest.fixture()
def exported(tmp_path: Path) -> Path:
    return export(_model(), CFG, SPEC, tmp_path / "dflash", meta={"global_step": 5})


GOLDEN = {
    "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
    "hidden_size": 16, "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 4, "hidden_act": "silu", "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "max_position_embeddings": 256, "vocab_size": 32, "attention_bias": False, "tie_word_embeddings": False,
    "torch_dtype": "float32", "dtype": "float32",
    "block_size": 4, "num_target_layers": 8, "layer_types": ["full_attention", "full_attention"],
    "dflash_config": {"mask_token_id": 31, "target_layer_ids": [1, 3, 5], "use_aux_hidden_state": True,
                      "causal": False},
    "eagle_aux_hidden_state_layer_ids": [2, 4, 6],  # vLLM capture index = output-of-layer id + 1
}


def test_config_json_golden(exported: Path) -> None:
    config = json.loads((exported / "config.json").read_text())
    assert config == GOLDEN
    assert "eagle_config" not in config  # docs/design/engines.md section 1.3: it would override the layer ids silently
    meta = json.loads((exported / META_FILE).read_text())
    assert meta["family"] == "dflash" and meta["format"] == "native" and meta["global_step"] == 5
    assert meta["drafter_config"]["loss_gamma"] == 2.5 and meta["drafter_config"]["target_layer_ids"] == [1, 3, 5]
    assert DFlashExportConfig.from_dict(meta["engine_format"]) == DFlashExportConfig.from_drafter(CFG, SPEC)


def test_export_check_load_round_trip_is_bit_exact(exported: Path) -> None:
    model = _model()
    tensors = load_file(str(exported / "model.safetensors"))
    assert set(tensors) == ENGINE_NAMES  # no embed_tokens, lm_head, mask_hidden, target buffers
    assert tuple(tensors["fc.weight"].shape) == (16, 3 * 16)
    want = model.state_dict()
    for name, t in tensors.items():
        assert t.dtype == torch.float32 and torch.equal(t, want[name]), name
    cfg = check_export(exported)
    assert cfg == DFlashExportConfig.from_drafter(CFG, SPEC)
    loaded = FAMILY.load_export(exported, _head())
    assert not loaded.training and loaded.cfg == CFG.resolve(SPEC)
    got = loaded.state_dict()
    assert sorted(got) == sorted(want)
    for name in want:
        assert got[name].dtype == want[name].dtype and torch.equal(got[name], want[name]), name
    assert torch.equal(loaded.target_embed_tokens, model.target_embed_tokens)
    assert torch.equal(loaded.target_lm_head, model.target_lm_head)
    assert engine_tensors(model.state_dict(), cfg).keys() == tensors.keys()  # export == live publish tensors


def test_bfloat16_export_round_trip(tmp_path: Path) -> None:
    model = _model()
    out = export(model, CFG, SPEC, tmp_path / "bf16", dtype=torch.bfloat16)
    config = json.loads((out / "config.json").read_text())
    assert config["torch_dtype"] == config["dtype"] == "bfloat16"
    assert check_export(out).dtype == "bfloat16"
    loaded = FAMILY.load_export(out, _head())
    for name, t in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], t.to(torch.bfloat16)), name


def test_load_refuses_a_target_of_other_sizes(exported: Path) -> None:
    other = tiny_spec(vocab=32, hidden=16, layers=10, heads=4, kv_heads=2)
    head = TargetHead(other, torch.randn(32, 16), torch.randn(32, 16), torch.ones(16))
    with pytest.raises(ValueError, match="does not match the target"):
        FAMILY.load_export(exported, head)


# -- planted faults: each refused by check_export, the message naming the culprit -------------------------

def _edit_config(edit: Callable[[dict[str, Any]], None]) -> Callable[[Path], None]:
    def apply(root: Path) -> None:
        config = json.loads((root / "config.json").read_text())
        edit(config)
        (root / "config.json").write_text(json.dumps(config))
    return apply


def _edit_tensors(edit: Callable[[dict[str, torch.Tensor]], None]) -> Callable[[Path], None]:
    def apply(root: Path) -> None:
        tensors = load_file(str(root / "model.safetensors"))
        edit(tensors)
        save_file(tensors, str(root / "model.safetensors"))
    return apply


def _set(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    return lambda c: c.__setitem__(key, value)


def _set_dflash(key: str, value: Any) -> Callable[[dict[str, Any]], None]:
    return lambda c: c["dflash_config"].__setitem__(key, value)


def _nan(t: dict[str, torch.Tensor]) -> None:
    t["layers.1.mlp.down_proj.weight"][0, 0] = float("nan")


FAULTS: dict[str, tuple[Callable[[Path], None], tuple[str, ...]]] = {
    "eagle_config dict": (_edit_config(_set("eagle_config", {"use_aux_hidden_state": True})),
                          ("'eagle_config'", "use_aux_hidden_state", "expected absent")),
    "eagle_config with the same ids": (_edit_config(_set("eagle_config", {"eagle_aux_hidden_state_layer_ids": [2, 4, 6]})),
                                       ("'eagle_config'", "expected absent")),
    "vllm ids disagree": (_edit_config(_set("eagle_aux_hidden_state_layer_ids", [1, 3, 5])),
                          ("eagle_aux_hidden_state_layer_ids [1, 3, 5]", "[1, 3, 5]", "expected [2, 4, 6]")),
    "dflash ids disagree": (_edit_config(_set_dflash("target_layer_ids", [1, 3, 6])),
                            ("eagle_aux_hidden_state_layer_ids [2, 4, 6]", "target_layer_ids [1, 3, 6]",
                             "expected [2, 4, 7]")),
    "wrong architecture": (_edit_config(_set("architectures", ["Qwen3ForCausalLM"])),
                           ("architectures ['Qwen3ForCausalLM']", "['DFlashDraftModel']")),
    "wrong model_type": (_edit_config(_set("model_type", "llama")), ("model_type 'llama'", "'qwen3'")),
    "causal draft": (_edit_config(_set_dflash("causal", True)), ("'dflash_config'", "'causal': True", "'causal': False")),
    "sliding layer": (_edit_config(_set("layer_types", ["full_attention", "sliding_attention"])),
                      ("'layer_types'", "sliding_attention", "['full_attention', 'full_attention']")),
    "unexpected config key": (_edit_config(_set("is_causal", True)), ("unexpected keys ['is_causal']",)),
    "mask id outside vocab": (_edit_config(_set_dflash("mask_token_id", 32)), ("config.json", "mask_token_id: got 32", "0..31")),
    "missing tensor": (_edit_tensors(lambda t: t.pop("layers.1.self_attn.k_norm.weight")),
                       ("missing tensors ['layers.1.self_attn.k_norm.weight']",)),
    "unexpected tensor": (_edit_tensors(lambda t: t.__setitem__("layers.2.mlp.up_proj.weight", torch.ones(32, 16))),
                          ("unexpected tensors ['layers.2.mlp.up_proj.weight']",)),
    "embed_tokens": (_edit_tensors(lambda t: t.__setitem__("embed_tokens.weight", torch.ones(32, 16))),
                     ("'embed_tokens.weight'", "must not be exported")),
    "lm_head": (_edit_tensors(lambda t: t.__setitem__("lm_head.weight", torch.ones(32, 16))),
                ("'lm_head.weight'", "must not be exported")),
    "mask_hidden": (_edit_tensors(lambda t: t.__setitem__("mask_hidden", torch.ones(16))),
                    ("'mask_hidden'", "must not be exported")),
    "wrong shape": (_edit_tensors(lambda t: t.__setitem__("layers.0.self_attn.q_norm.weight", torch.ones(16))),
                    ("'layers.0.self_attn.q_norm.weight'", "shape (16,)", "expected (4,)")),
    "fc width": (_edit_tensors(lambda t: t.__setitem__("fc.weight", torch.ones(16, 32))),
                 ("'fc.weight'", "input width 32", "len(target_layer_ids)=3 x hidden_size=16 = 48")),
    "non-finite": (_edit_tensors(_nan), ("'layers.1.mlp.down_proj.weight'", "non-finite", "1 of 512")),
    "wrong dtype": (_edit_tensors(lambda t: t.__setitem__("norm.weight", t["norm.weight"].half())),
                    ("'norm.weight'", "torch.float16", "expected torch.float32")),
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_check_export_refuses_a_planted_fault(exported: Path, fault: str) -> None:
    check_export(exported)  # clean before the fault
    plant, fragments = FAULTS[fault]
    plant(exported)
    with pytest.raises(ValueError) as err:
        check_export(exported)
    message = str(err.value)
    for fragment in fragments:
        assert fragment in message, (fault, fragment, message)
    with pytest.raises(ValueError):  # the reader checks first
        FAMILY.load_export(exported, _head())


def test_engine_tensors_refuse_a_bad_state_dict() -> None:
    cfg = DFlashExportConfig.from_drafter(CFG, SPEC)
    state = _model().state_dict()
    with pytest.raises(ValueError, match=r"missing tensors \['norm.weight'\]"):
        engine_tensors({k: v for k, v in state.items() if k != "norm.weight"}, cfg)
    with pytest.raises(ValueError, match="'lm_head.weight' must not be exported"):
        engine_tensors({**state, "lm_head.weight": torch.ones(32, 16)}, cfg)
    frozen = {**state, "target_embed_tokens": torch.ones(32, 16), "target_lm_head": torch.ones(32, 16)}
    assert set(engine_tensors(frozen, cfg)) == ENGINE_NAMES  # the frozen target buffers are dropped


# -- engine arguments and the engine-format dict ---------------------------------------------------------

def test_speculative_arguments_and_the_k_rule(tmp_path: Path) -> None:
    cfg = DFlashExportConfig.from_drafter(CFG, SPEC)  # block_size 4: 3 drafts per block
    assert cfg.vllm_speculative_config(tmp_path, 3) == {"method": "dflash", "model": str(tmp_path),
                                                        "num_speculative_tokens": 3}
    for k in (4, 2, 16):
        with pytest.raises(ValueError, match=rf"num_speculative_tokens={k}, expected block_size - 1 = 3"):
            cfg.vllm_speculative_config(tmp_path, k)
    assert cfg.sglang_server_args(tmp_path, 3) == {"speculative_algorithm": "DFLASH",
                                                   "speculative_draft_model_path": str(tmp_path),
                                                   "speculative_num_draft_tokens": 4}
    with pytest.raises(ValueError, match="expected block_size - 1 = 3"):
        cfg.sglang_server_args(tmp_path, 4)
    assert set(cfg.sglang_expected_shapes()) == ENGINE_NAMES
    assert set(cfg.sglang_never_published()) == {"embed_tokens.weight", "lm_head.weight"}


def test_to_dict_from_dict_round_trip_and_unknown_keys() -> None:
    cfg = DFlashExportConfig.from_drafter(CFG, SPEC, dtype="bfloat16")
    data = json.loads(json.dumps(cfg.to_dict()))  # JSON-able
    assert data["family"] == "dflash" and data["target_layer_ids"] == [1, 3, 5]
    assert DFlashExportConfig.from_dict(data) == cfg
    with pytest.raises(ValueError, match=r"unknown keys \['eagle_config'\], missing keys \[\]"):
        DFlashExportConfig.from_dict({**data, "eagle_config": {}})
    with pytest.raises(ValueError, match=r"missing keys \['block_size'\]"):
        DFlashExportConfig.from_dict({k: v for k, v in data.items() if k != "block_size"})
    with pytest.raises(ValueError, match="family 'eagle3', expected 'dflash'"):
        DFlashExportConfig.from_dict({**data, "family": "eagle3"})


def test_export_config_validation_names_field_and_value() -> None:
    cfg = DFlashExportConfig.from_drafter(CFG, SPEC)
    with pytest.raises(ValueError, match="mask_token_id: got 40"):
        replace(cfg, mask_token_id=40)
    with pytest.raises(ValueError, match=r"target_layer_ids: got \(3, 1\)"):
        replace(cfg, target_layer_ids=(3, 1))
    with pytest.raises(ValueError, match=r"target_layer_ids: got \(1, 7\).*within 0..6"):
        replace(cfg, target_layer_ids=(1, 7))  # output of the last layer is never captured
    with pytest.raises(ValueError, match="block_size: got 1"):
        replace(cfg, block_size=1)
    with pytest.raises(ValueError, match="dtype: got 'int8'"):
        replace(cfg, dtype="int8")
