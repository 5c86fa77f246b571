"""TargetSpec / TargetHead read real HF checkpoints (saved by transformers) without transformers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from drafters.common.target import TargetHead, TargetLoadError, TargetSpec


def _save_qwen3(path: Path, tie: bool, shard: str | None = None) -> torch.nn.Module:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=64, hidden_size=32, num_hidden_layers=4, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, intermediate_size=48, max_position_embeddings=128,
                      rope_theta=5000.0, rms_norm_eps=1e-5, tie_word_embeddings=tie)
    model = Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():
        model.model.norm.weight.uniform_(0.5, 1.5)
    model.save_pretrained(path, max_shard_size=shard) if shard else model.save_pretrained(path)
    return model


@pytest.mark.parametrize("tie,shard", [(False, None), (True, None), (False, "20KB")])
def test_head_matches_hf_model(tmp_path: Path, tie: bool, shard: str | None) -> None:
    model = _save_qwen3(tmp_path, tie, shard)
    assert (tmp_path / "model.safetensors.index.json").is_file() == bool(shard)
    head = TargetHead.from_pretrained(tmp_path)
    spec = head.spec
    assert (spec.vocab_size, spec.hidden_size, spec.num_hidden_layers, spec.num_attention_heads) == (64, 32, 4, 4)
    assert (spec.num_key_value_heads, spec.head_dim, spec.intermediate_size) == (2, 16, 48)
    assert (spec.rope_theta, spec.rms_norm_eps, spec.max_position_embeddings) == (5000.0, 1e-5, 128)
    assert spec.model_type == "qwen3" and spec.tie_word_embeddings == tie
    torch.testing.assert_close(head.embed_tokens, model.model.embed_tokens.weight.detach())
    torch.testing.assert_close(head.lm_head, model.lm_head.weight.detach())
    torch.testing.assert_close(head.final_norm, model.model.norm.weight.detach())
    assert not head.lm_head.requires_grad
    # internal convention: last_hidden = HF hidden_states[-1] is post-final-norm; logits = lm_head(it)
    ids = torch.tensor([[1, 5, 9, 2]])
    out = model(input_ids=ids, output_hidden_states=True)
    torch.testing.assert_close(head.logits(out.hidden_states[-1]), out.logits, atol=1e-5, rtol=1e-5)


def test_untied_config_without_lm_head_fails(tmp_path: Path) -> None:
    _save_qwen3(tmp_path, tie=True)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["tie_word_embeddings"] = False
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(TargetLoadError, match="tie_word_embeddings=false but no lm_head.weight"):
        TargetHead.from_pretrained(tmp_path)


def test_spec_errors_and_nested_text_config(tmp_path: Path) -> None:
    with pytest.raises(TargetLoadError, match="no config.json"):
        TargetSpec.from_pretrained(tmp_path)
    with pytest.raises(TargetLoadError, match="missing 'hidden_size'"):
        TargetSpec.from_hf_config({"vocab_size": 3})
    nested = {"model_type": "qwen3_vl", "text_config": {"vocab_size": 8, "hidden_size": 4, "num_hidden_layers": 2,
                                                        "num_attention_heads": 2, "rope_theta": 7.0}}
    spec = TargetSpec.from_hf_config(nested)
    assert (spec.vocab_size, spec.head_dim, spec.num_key_value_heads, spec.rope_theta) == (8, 2, 2, 7.0)


def _tokenizer_files(root: Path, added: dict[str, int], mask_token: str | None = None) -> None:
    (root / "tokenizer.json").write_text(json.dumps(
        {"added_tokens": [{"id": i, "content": c, "special": True} for c, i in added.items()]}))
    (root / "tokenizer_config.json").write_text(json.dumps({} if mask_token is None else {"mask_token": mask_token}))


def test_mask_token_comes_from_the_tokenizer(tmp_path: Path) -> None:
    """The block drafters' MASK id default: tokenizer_config's `mask_token`, else an added token
    with a mask name (SGLang's `<|MASK|>` first); none -> None; a bad one is refused."""
    from drafters.dflash.config import DFlashConfig

    _save_qwen3(tmp_path, tie=False)
    assert TargetSpec.from_pretrained(tmp_path).mask_token_id is None  # no tokenizer files
    _tokenizer_files(tmp_path, {"<pad>": 0, "<|mask|>": 7, "<|MASK|>": 9})
    spec = TargetSpec.from_pretrained(tmp_path)
    assert (spec.mask_token, spec.mask_token_id) == ("<|MASK|>", 9)
    _tokenizer_files(tmp_path, {"<pad>": 0, "<|mask|>": 7, "<|MASK|>": 9}, mask_token="<|mask|>")
    spec = TargetSpec.from_pretrained(tmp_path)
    assert (spec.mask_token, spec.mask_token_id) == ("<|mask|>", 7)
    assert DFlashConfig(num_target_features=2, target_layer_ids=(0, 2)).resolve(spec).mask_token_id == 7
    assert DFlashConfig(num_target_features=2, target_layer_ids=(0, 2), mask_token_id=5).resolve(spec).mask_token_id == 5
    _tokenizer_files(tmp_path, {"<pad>": 0})
    with pytest.raises(ValueError, match="mask_token_id: got None.*tokenizer has none"):
        DFlashConfig(num_target_features=2, target_layer_ids=(0, 2)).resolve(TargetSpec.from_pretrained(tmp_path))
    _tokenizer_files(tmp_path, {"<pad>": 0}, mask_token="<m>")
    with pytest.raises(TargetLoadError, match="mask_token '<m>' is not an added token"):
        TargetSpec.from_pretrained(tmp_path)
    _tokenizer_files(tmp_path, {"<|mask|>": 10_000})
    with pytest.raises(TargetLoadError, match=r"mask token '<\|mask\|>' has id 10000, expected an id in 0\.\.63"):
        TargetSpec.from_pretrained(tmp_path)
