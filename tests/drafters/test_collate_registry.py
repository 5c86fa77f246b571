"""Collate padding and the catalog."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from drafters import available_families, get_family, known_families
from drafters.common.collate import collate
from drafters.registry import (
    UnknownEngineMethodError,
    UnknownFamilyError,
    catalog_entry,
    draft_depth_settings,
    engine_method,
    has_engine_method,
)


def test_collate_pads_right_with_attention_mask() -> None:
    a = {"input_ids": torch.tensor([5, 6, 7]), "loss_mask": torch.tensor([0, 1, 1], dtype=torch.uint8),
         "aux_hidden": torch.ones(3, 4, dtype=torch.bfloat16), "global_step": torch.tensor(3)}
    b = {"input_ids": torch.tensor([9]), "loss_mask": torch.tensor([1], dtype=torch.uint8),
         "aux_hidden": 2 * torch.ones(1, 4, dtype=torch.bfloat16), "global_step": torch.tensor(4)}
    batch = collate([a, b])
    assert batch["input_ids"].tolist() == [[5, 6, 7], [9, 0, 0]]
    assert batch["loss_mask"].tolist() == [[0, 1, 1], [1, 0, 0]]
    assert batch["attention_mask"].tolist() == [[True, True, True], [True, False, False]]
    assert batch["lengths"].tolist() == [3, 1] and batch["global_step"].tolist() == [3, 4]
    assert batch["aux_hidden"].dtype == torch.bfloat16
    assert batch["aux_hidden"][1].sum(-1).tolist() == [8.0, 0.0, 0.0]
    assert collate([a, b], pad_to_multiple_of=4)["input_ids"].shape == (2, 4)
    bad = dict(b, aux_hidden=torch.ones(2, 4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="field 'aux_hidden'"):
        collate([a, bad])


def test_catalog() -> None:
    assert known_families() == ("eagle1", "eagle2", "eagle3", "dflash", "dspark", "domino", "peagle")
    assert available_families() == known_families()  # every catalog entry is implemented
    assert [get_family(n).name for n in known_families()] == list(known_families())
    with pytest.raises(UnknownFamilyError, match="valid names: eagle1, eagle2, eagle3, dflash"):
        get_family("medusa")
    assert engine_method("eagle1", "vllm").method == "eagle"
    assert engine_method("eagle2", "vllm").method == "eagle"
    assert engine_method("eagle3", "vllm").method == "eagle3"
    assert engine_method("eagle3", "sglang").method == "EAGLE3"
    assert dict(engine_method("peagle", "vllm").extra) == {"parallel_drafting": True}
    assert engine_method("peagle", "vllm").method == "eagle3"
    with pytest.raises(UnknownEngineMethodError, match="'peagle' has no known sglang method"):
        engine_method("peagle", "sglang")  # SGLang 0.5.23 has no P-EAGLE (docs/design/engines.md section 4.4)
    assert engine_method("domino", "sglang").method == "DFLASH"  # DFLASH with dflash_config.projector_type domino
    with pytest.raises(UnknownEngineMethodError, match="'domino' has no known vllm method"):
        engine_method("domino", "vllm")  # vLLM 0.32 has no Domino (docs/design/engines.md section 2.6)
    assert [engine_method(n, "vllm").label() for n in ("eagle2", "peagle")] == ["eagle, EAGLE-1 chain",
                                                                                 "eagle3 + parallel_drafting"]
    assert not has_engine_method("domino", "vllm") and has_engine_method("domino", "sglang")


def test_draft_depth_settings_are_what_the_engine_formats_accept(tmp_path: Path) -> None:
    """`draft_depth_settings(name, k)` (the catalog's draft_depth) gives a config whose engine format
    serves exactly k drafts per round (DFlash, Domino: block_size - 1; DSpark: block_size; P-EAGLE: up
    to num_depths); the chain and tree families have no such setting."""
    from drafters.common.target import TargetSpec

    spec = TargetSpec(vocab_size=37, hidden_size=32, num_hidden_layers=8, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, intermediate_size=64, rope_theta=10000.0,
                      rms_norm_eps=1e-6, max_position_embeddings=128, model_type="qwen3", tie_word_embeddings=False)
    assert draft_depth_settings("dflash", 3) == {"block_size": 4} and draft_depth_settings("dspark", 7) == {
        "block_size": 7}
    for name in known_families():
        if catalog_entry(name).draft_depth is None:
            assert draft_depth_settings(name, 3) == {}, name
            continue
        family = get_family(name)
        for k in (3, 7):
            settings = draft_depth_settings(name, k)
            fields = {f.name for f in dataclasses.fields(family.config_cls)}
            extra = {"mask_token_id": spec.vocab_size - 1} if "mask_token_id" in fields else {}
            fmt = family.engine_format(family.resolve(family.config_cls(**settings, **extra), spec), spec)
            if has_engine_method(name, "vllm"):
                serve = fmt.vllm_speculative_config
            else:  # Domino: SGLang only, from a bf16 export
                serve = dataclasses.replace(fmt, dtype="bfloat16").sglang_server_args  # type: ignore[type-var]
            serve(tmp_path, k)
            with pytest.raises(ValueError, match="num_speculative_tokens"):
                serve(tmp_path, k + 1)
