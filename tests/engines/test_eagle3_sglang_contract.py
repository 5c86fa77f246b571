"""The SGLang LlamaForCausalLMEagle3 contract checker accepts our native export and names each defect."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from drafters.eagle3.export import export_eagle3
from drafters.eagle3.sglang import SGLangContractError, check_sglang_eagle3_export

from .conftest import AUX_IDS, LAYERS, draft_config, random_draft

KEPT = list(range(0, 96, 2))  # 48-token draft vocab


@pytest.fixture()
def native(tmp_path: Path) -> Path:
    cfg = draft_config(draft_vocab_size=len(KEPT))
    return export_eagle3(random_draft(cfg, kept=KEPT), cfg, tmp_path / "native")


def _edit_tensors(path: Path, fn: Callable[[dict[str, torch.Tensor]], None]) -> None:
    tensors = load_file(str(path / "model.safetensors"))
    fn(tensors)
    save_file(tensors, str(path / "model.safetensors"))


def _edit_config(path: Path, **changes: Any) -> None:
    cfg = json.loads((path / "config.json").read_text())
    cfg.update(changes)
    (path / "config.json").write_text(json.dumps(cfg))


def test_native_export_satisfies_the_contract(native: Path) -> None:
    cfg = check_sglang_eagle3_export(native, expected_aux_layer_ids=AUX_IDS, target_num_hidden_layers=LAYERS)
    assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]


def test_model_prefixed_names_are_accepted_except_lm_head(native: Path) -> None:
    _edit_tensors(native, lambda t: t.update({"model.fc.weight": t.pop("fc.weight")}))
    check_sglang_eagle3_export(native)
    _edit_tensors(native, lambda t: t.update({"model.lm_head.weight": t.pop("lm_head.weight")}))
    with pytest.raises(SGLangContractError, match="model.lm_head.weight: not a parameter"):
        check_sglang_eagle3_export(native)


@pytest.mark.parametrize(("edit", "message"), [
    (lambda t: t.update({"fc.weight": torch.zeros(64, 128)}), r"fc.weight: shape \(64, 128\), expected \(64, 192\)"),
    (lambda t: t.update({"midlayer.self_attn.k_proj.weight": torch.zeros(64, 64)}),
     r"midlayer.self_attn.k_proj.weight: shape \(64, 64\), expected \(64, 128\)"),
    (lambda t: t.pop("norm.weight"), r"norm.weight: missing \(expected shape \(64,\)\)"),
    (lambda t: t.pop("d2t"), r"d2t: missing; draft_vocab_size 48 < vocab_size 96"),
    (lambda t: t.update({"d2t": torch.tensor(KEPT)}), r"d2t: target ids i \+ d2t\[i\] span \[0, 141\]"),
    (lambda t: t.update({"d2t": torch.zeros(48, dtype=torch.int32)}), r"d2t: dtype torch.int32"),
    (lambda t: t.update({"midlayers.0.extra": torch.zeros(1)}), r"midlayers.0.extra: not a parameter .* silently"),
])
def test_tensor_defects_are_named(native: Path, edit: Callable[[dict[str, torch.Tensor]], None],
                                  message: str) -> None:
    _edit_tensors(native, edit)
    with pytest.raises(SGLangContractError, match=message):
        check_sglang_eagle3_export(native)


@pytest.mark.parametrize(("changes", "message"), [
    ({"tie_word_embeddings": True}, r"config.tie_word_embeddings: got True, expected False"),
    ({"architectures": ["Eagle3Speculator"]}, r"config.architectures: got \['Eagle3Speculator'\]"),
    ({"norm_before_residual": True}, r"config.norm_before_residual: got True"),
    ({"draft_vocab_size": None}, r"config.draft_vocab_size: missing"),
    ({"hidden_act": "gelu"}, r"config.hidden_act: got 'gelu'"),
    ({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 3, 4]}}, r"expected a list of 3 ids"),
    ({"eagle_config": {}}, r"eagle_aux_hidden_state_layer_ids: got None"),
])
def test_config_defects_are_named(native: Path, changes: dict[str, Any], message: str) -> None:
    _edit_config(native, **changes)
    with pytest.raises(SGLangContractError, match=message):
        check_sglang_eagle3_export(native)


def test_layer_ids_are_checked_in_sglang_convention(native: Path) -> None:
    with pytest.raises(SGLangContractError, match=r"got \[1, 3, 4\], expected \[2, 3, 4\] \(internal \[3, 4, 5\] - 1\)"):
        check_sglang_eagle3_export(native, expected_aux_layer_ids=(3, 4, 5), target_num_hidden_layers=LAYERS)
    _edit_config(native, eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 3, 7]})
    with pytest.raises(SGLangContractError, match=r"\[7\] capture at index id\+1 outside \[0, 7\]"):
        check_sglang_eagle3_export(native, target_num_hidden_layers=LAYERS)


def test_speculators_layout_is_rejected(tmp_path: Path) -> None:
    cfg = draft_config(draft_vocab_size=len(KEPT))
    out = export_eagle3(random_draft(cfg, kept=KEPT), cfg, tmp_path / "spec", fmt="speculators", verifier="t")
    with pytest.raises(SGLangContractError, match="config.architectures"):
        check_sglang_eagle3_export(out)
    # Even with a native config, `layers.0.*` names load nothing in SGLang: every one is reported.
    (out / "config.json").write_text(json.dumps(json.loads((tmp_path / "spec" / "config.json").read_text())
                                                ["transformer_layer_config"] | {
        "architectures": ["LlamaForCausalLMEagle3"], "draft_vocab_size": 48, "target_hidden_size": 64,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 3, 4]}}))
    with pytest.raises(SGLangContractError) as err:
        check_sglang_eagle3_export(out)
    text = str(err.value)
    assert "layers.0.self_attn.q_proj.weight: not a parameter" in text
    assert "midlayer.self_attn.q_proj.weight: missing (expected shape (128, 128))" in text
