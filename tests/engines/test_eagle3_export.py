"""EAGLE-3 export formats: exact config.json content, tensor names, round trip, rejected inputs."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from drafters.eagle3.export import META_FILE, export_eagle3, load_export

from .conftest import VOCAB, draft_config, random_draft

KEPT = [0, 1, 3, 8, 9, 20, 33, 34, 50, 77, 90, 95]  # sorted target ids of a 12-token draft vocab


def _names(path: Path) -> set[str]:
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        return set(f.keys())


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    for name in a:
        assert a[name].dtype == b[name].dtype and torch.equal(a[name], b[name]), name


def test_native_export_config_names_and_round_trip(tmp_path: Path) -> None:
    cfg = draft_config(draft_vocab_size=len(KEPT))
    sd = random_draft(cfg, kept=KEPT)
    out = export_eagle3(sd, cfg, tmp_path / "native", meta={"global_step": 7})
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["model_type"] == "llama"
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]  # vLLM: capture index = internal id
    assert config["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [1, 3, 4], "use_aux_hidden_state": True}
    assert (config["num_hidden_layers"], config["vocab_size"], config["draft_vocab_size"]) == (1, VOCAB, 12)
    assert (config["target_hidden_size"], config["tie_word_embeddings"], config["norm_before_residual"]) == (
        64, False, False)
    names = _names(out)
    assert "midlayer.self_attn.q_proj.weight" in names and {"d2t", "t2d"} <= names
    assert "embed_tokens.weight" not in names and not any(n.startswith("layers.") for n in names)
    meta = json.loads((out / META_FILE).read_text())
    assert meta["format"] == "native" and meta["global_step"] == 7 and meta["export_config"]["aux_layer_ids"] == [2, 4, 5]
    loaded, cfg2 = load_export(out)
    assert cfg2 == cfg
    _assert_same(loaded, {k: v for k, v in sd.items() if k != "embed_tokens.weight"})
    assert torch.equal(torch.arange(12) + loaded["d2t"], torch.tensor(KEPT))  # offsets, not ids


def test_speculators_export_layout_and_round_trip(tmp_path: Path) -> None:
    cfg = draft_config(draft_vocab_size=len(KEPT))
    sd = random_draft(cfg, kept=KEPT)
    out = export_eagle3(sd, cfg, tmp_path / "spec", fmt="speculators", verifier="/models/target",
                        speculative_tokens=5, verifier_architectures=["Qwen3ForCausalLM"])
    config = json.loads((out / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3" and "architectures" in config
    assert config["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 5
    assert config["speculators_config"]["verifier"] == {"name_or_path": "/models/target",
                                                        "architectures": ["Qwen3ForCausalLM"]}
    layer = config["transformer_layer_config"]
    assert (layer["model_type"], layer["num_hidden_layers"], layer["vocab_size"]) == ("llama", 1, VOCAB)
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5] and "eagle_config" not in config
    assert config["norm_before_residual"] is False  # speculators/vLLM default it to True when absent
    names = _names(out)
    assert "layers.0.hidden_norm.weight" in names and not any(n.startswith("midlayer.") for n in names)
    loaded, cfg2 = load_export(out)
    assert cfg2 == cfg
    _assert_same(loaded, {k: v for k, v in sd.items() if k != "embed_tokens.weight"})


def test_full_vocab_export_omits_the_maps_and_reads_back_identity(tmp_path: Path) -> None:
    cfg = draft_config()
    out = export_eagle3(random_draft(cfg), cfg, tmp_path / "full")
    assert not {"d2t", "t2d"} & _names(out)
    loaded, _ = load_export(out)
    assert torch.equal(loaded["d2t"], torch.zeros(VOCAB, dtype=torch.int64)) and bool(loaded["t2d"].all())


@pytest.mark.parametrize(("mutate", "message"), [
    (lambda sd: sd.update({"fc.weight": torch.zeros(64, 128)}), r"fc.weight: shape \(64, 128\), expected \(64, 192\)"),
    (lambda sd: sd.pop("norm.weight"), r"missing \['norm.weight'\]"),
    (lambda sd: sd.update({"midlayer.extra.weight": torch.zeros(1)}), r"unexpected \['midlayer.extra.weight'\]"),
    (lambda sd: sd.update({"d2t": torch.tensor(KEPT)}), r"d2t: target ids .* was d2t stored as ids"),
    (lambda sd: sd.update({"t2d": torch.ones(VOCAB, dtype=torch.bool)}), r"t2d: does not mark exactly"),
])
def test_bad_state_dicts_are_rejected_naming_the_tensor(tmp_path: Path, mutate, message: str) -> None:
    cfg = draft_config(draft_vocab_size=len(KEPT))
    sd = random_draft(cfg, kept=KEPT)
    mutate(sd)
    with pytest.raises(ValueError, match=message):
        export_eagle3(sd, cfg, tmp_path / "bad")


def test_full_vocab_rejects_a_non_identity_d2t(tmp_path: Path) -> None:
    cfg = draft_config()
    sd = random_draft(cfg)
    sd["d2t"] = torch.arange(VOCAB)  # the "d2t = arange" initialisation bug: draft i -> target 2i
    with pytest.raises(ValueError, match="d2t: target ids"):
        export_eagle3(sd, cfg, tmp_path / "bad")


def test_bad_configs_are_rejected() -> None:
    with pytest.raises(ValueError, match="aux_layer_ids: got \\(5, 2, 4\\)"):
        replace(draft_config(), aux_layer_ids=(5, 2, 4))
    with pytest.raises(ValueError, match="target_hidden_size"):
        replace(draft_config(), target_hidden_size=128)
    with pytest.raises(ValueError, match="draft_vocab_size: got 97"):
        draft_config(draft_vocab_size=97)


def test_speculators_without_verifier_and_unknown_formats(tmp_path: Path) -> None:
    cfg = draft_config()
    out = export_eagle3(random_draft(cfg), cfg, tmp_path / "s", fmt="speculators")
    assert json.loads((out / "config.json").read_text())["speculators_config"]["verifier"]["name_or_path"] is None
    with pytest.raises(ValueError, match="fmt: got 'sglang'"):
        export_eagle3(random_draft(cfg), cfg, tmp_path / "x", fmt="sglang")


def test_layer_ids_outside_the_target_are_rejected() -> None:
    with pytest.raises(ValueError, match="layer id 9: outside"):
        replace(draft_config(), aux_layer_ids=(2, 4, 9))


def test_bfloat16_export(tmp_path: Path) -> None:
    cfg = draft_config(draft_vocab_size=len(KEPT))
    out = export_eagle3(random_draft(cfg, kept=KEPT), cfg, tmp_path / "bf16", dtype=torch.bfloat16)
    loaded, _ = load_export(out)
    assert loaded["fc.weight"].dtype == torch.bfloat16 and loaded["d2t"].dtype == torch.int64
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"


@pytest.mark.parametrize("fmt", ["native", "speculators"])
def test_family_export_of_a_two_layer_drafters_model(tmp_path: Path, fmt: str) -> None:
    from drafters.common.target import TargetHead, TargetSpec
    from drafters.eagle3 import FAMILY, Eagle3Config

    from .conftest import build_target

    target = build_target(tmp_path / "target")
    spec = TargetSpec.from_pretrained(target)
    cfg = Eagle3Config(num_layers=2)
    model = FAMILY.build(cfg, TargetHead.from_pretrained(target))
    out = FAMILY.export(model, cfg, spec, tmp_path / fmt, fmt)
    config = json.loads((out / "config.json").read_text())
    layer = config.get("transformer_layer_config", config)
    assert layer["num_hidden_layers"] == 2 and config["eagle_aux_hidden_state_layer_ids"] == [2, 4, 5]
    assert "layers.1.self_attn.q_proj.weight" in _names(out) and not {"d2t", "t2d"} & _names(out)
    loaded, export_cfg = load_export(out)
    assert export_cfg.num_layers == 2 and export_cfg.aux_layer_ids == (2, 4, 5)
    _assert_same(loaded, {k: v for k, v in model.state_dict().items() if k != "embed_tokens.weight"})
    if fmt == "native":  # vLLM serves extra layers; SGLang's differ, and its checker says so
        from drafters.eagle3.sglang import SGLangContractError, check_sglang_eagle3_export

        with pytest.raises(SGLangContractError, match="config.num_hidden_layers: got 2, expected 1"):
            check_sglang_eagle3_export(out)
