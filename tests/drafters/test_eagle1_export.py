"""EAGLE-1 export: exact config.json and tensor names, exact round trip, export == engine tensors,
and our check refusing what the engines refuse (naming the tensor) before any engine sees it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from drafter_targets import TinyTarget, tiny_spec
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from drafters.eagle1 import FAMILY, Eagle1Config, Eagle1Model
from drafters.eagle1.export import META_FILE, Eagle1ExportConfig, check_export, engine_tensors, load_export

ENGINE_NAMES = {"fc.weight", "fc.bias", "layers.0.self_attn.q_proj.weight", "layers.0.self_attn.k_proj.weight",
                "layers.0.self_attn.v_proj.weight", "layers.0.self_attn.o_proj.weight",
                "layers.0.mlp.gate_proj.weight", "layers.0.mlp.up_proj.weight", "layers.0.mlp.down_proj.weight",
                "layers.0.post_attention_layernorm.weight"}  # exactly what vLLM accepts, plus fc.bias


def _model(target: TinyTarget, **kw: object) -> Eagle1Model:
    torch.manual_seed(3)
    model = FAMILY.build(Eagle1Config(attn_backend="sdpa", **kw), target.head())  # type: ignore[arg-type]
    with torch.no_grad():  # a non-unit norm, so a dropped or re-initialised tensor shows
        model.layers[0].post_attention_layernorm.weight.uniform_(0.5, 1.5)
    return model


def _names(out: Path) -> set[str]:
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        return set(f.keys())


def test_export_config_names_and_exact_round_trip(tmp_path: Path) -> None:
    target = TinyTarget(tiny_spec())
    cfg = Eagle1Config(feature_noise=0.05, attn_backend="sdpa")
    model = _model(target, feature_noise=0.05)
    out = FAMILY.export(model, cfg, target.spec, tmp_path / "e1", meta={"global_step": 3})
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle", "EagleLlamaForCausalLM"]
    assert (config["model_type"], config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (
        "llama", 1, 16, 32)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (4, 2, 4)
    assert (config["intermediate_size"], config["torch_dtype"], config["tie_word_embeddings"]) == (32, "float32", False)
    assert _names(out) == ENGINE_NAMES
    tensors = load_file(str(out / "model.safetensors"))
    assert torch.equal(tensors["fc.bias"], torch.zeros(16))  # SGLang's fc has a bias: ship it as 0
    meta = json.loads((out / META_FILE).read_text())
    assert meta["family"] == "eagle1" and meta["global_step"] == 3 and meta["drafter_config"]["feature_noise"] == 0.05
    loaded = FAMILY.load_export(out, target.head())
    assert not loaded.training and loaded.cfg == cfg
    want, got = model.state_dict(), loaded.state_dict()
    assert sorted(want) == sorted(got)
    for name in want:
        assert want[name].dtype == got[name].dtype and torch.equal(want[name], got[name]), name
    assert torch.equal(loaded.target_lm_head, model.target_lm_head)
    assert check_export(out) == Eagle1ExportConfig.from_drafter(cfg, target.spec)


def test_export_tensors_are_the_engine_tensors(tmp_path: Path) -> None:
    target = TinyTarget(tiny_spec())
    model = _model(target)
    export_cfg = FAMILY.engine_format(Eagle1Config(), target.spec)
    out = FAMILY.export(model, Eagle1Config(), target.spec, tmp_path / "e1")
    on_disk, live = load_file(str(out / "model.safetensors")), export_cfg.engine_tensors(model.state_dict())
    assert sorted(on_disk) == sorted(live) == sorted(ENGINE_NAMES)
    for name in live:
        assert on_disk[name].dtype == live[name].dtype and torch.equal(on_disk[name], live[name]), name
    assert FAMILY.format_from_dict(json.loads(json.dumps(export_cfg.to_dict()))) == export_cfg
    assert export_cfg.vllm_speculative_config(out, 3) == {"method": "eagle", "model": str(out),
                                                          "num_speculative_tokens": 3}
    assert export_cfg.sglang_server_args(out, 3)["speculative_algorithm"] == "EAGLE"
    bf16 = FAMILY.export(model, Eagle1Config(), target.spec, tmp_path / "bf16", dtype=torch.bfloat16)
    assert json.loads((bf16 / "config.json").read_text())["torch_dtype"] == "bfloat16"
    assert load_export(bf16, target.head()).fc.weight.dtype == torch.bfloat16


@pytest.mark.parametrize("name", ["layers.0.input_layernorm.weight", "norm.weight", "lm_head.weight",
                                  "embed_tokens.weight"])
def test_check_export_refuses_what_the_engines_refuse(tmp_path: Path, name: str) -> None:
    target = TinyTarget(tiny_spec())
    out = FAMILY.export(_model(target), Eagle1Config(), target.spec, tmp_path / "e1")
    tensors = load_file(str(out / "model.safetensors"))
    tensors[name] = torch.ones(32, 16) if name in ("lm_head.weight", "embed_tokens.weight") else torch.ones(16)
    save_file(tensors, str(out / "model.safetensors"))
    with pytest.raises(ValueError, match=f"tensor '{name}' must not be exported"):
        check_export(out)
    with pytest.raises(ValueError, match=f"tensor '{name}' must not be exported"):
        FAMILY.load_export(out, target.head())
    sd = dict(_model(target).state_dict())
    sd[name] = tensors[name]
    if name != "embed_tokens.weight":  # the model's own frozen embedding is dropped, anything else refused
        with pytest.raises(ValueError, match=f"tensor '{name}' must not be exported"):
            engine_tensors(sd, FAMILY.engine_format(Eagle1Config(), target.spec))


def test_check_export_refuses_bias_missing_shape_and_config(tmp_path: Path) -> None:
    target = TinyTarget(tiny_spec())
    out = FAMILY.export(_model(target), Eagle1Config(), target.spec, tmp_path / "e1")
    good = load_file(str(out / "model.safetensors"))
    cases = [({**good, "fc.bias": torch.full((16,), 0.5)}, "tensor 'fc.bias' is not zero: vLLM drops it"),
             ({k: v for k, v in good.items() if k != "layers.0.mlp.up_proj.weight"},
              r"missing tensors \['layers.0.mlp.up_proj.weight'\]"),
             ({**good, "fc.weight": torch.zeros(16, 48)}, r"tensor 'fc.weight' has shape \(16, 48\), expected \(16, 32\)")]
    for tensors, message in cases:
        save_file(tensors, str(out / "model.safetensors"))
        with pytest.raises(ValueError, match=message):
            check_export(out)
    save_file(good, str(out / "model.safetensors"))
    config = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "architectures": ["EagleLlamaForCausalLM"]}))
    with pytest.raises(ValueError, match="architectures"):
        check_export(out)
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="does not match the target's sizes"):
        load_export(out, TinyTarget(tiny_spec(hidden=16, heads=2, kv_heads=2)).head())
    sd = {**_model(target).state_dict(), "fc.bias": torch.ones(16)}
    with pytest.raises(ValueError, match="'fc.bias' is not zero"):
        engine_tensors(sd, FAMILY.engine_format(Eagle1Config(), target.spec))
