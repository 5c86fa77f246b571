"""Collate padding and the catalog."""

from __future__ import annotations

import pytest
import torch

from drafters import available_families, get_family, known_families
from drafters.common.collate import collate
from drafters.registry import (
    UnknownEngineMethodError,
    UnknownFamilyError,
    engine_method,
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
