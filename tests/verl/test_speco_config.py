"""configs/speco_trainer.yaml: composes verl's ppo_trainer, mirrors DrafterRunConfig, no dead keys."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf
from speco_verl_helpers import ROOT, compose

from verl_speco.online.config import DrafterConfigError, DrafterRunConfig
from verl_speco.verl_integration.config_bridge import (
    apply_speculative_config,
    drafter_from_actor_rollout_ref,
    extract_drafter,
)


def _defaults(cls: type) -> dict[str, Any]:
    return dataclasses.asdict(cls())


def _field_paths(cls: type, prefix: str = "") -> list[tuple[str, str]]:
    """(dotted path, attribute name) of every field, recursively."""
    out = []
    for f in dataclasses.fields(cls):
        out.append((prefix + f.name, f.name))
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else None  # type: ignore[misc]
        if dataclasses.is_dataclass(default):
            out += _field_paths(type(default), prefix + f.name + ".")
    return out


def test_composes_verl_ppo_trainer_with_drafter_defaults() -> None:
    cfg = compose()
    assert cfg.trainer.use_v1 is True and "actor" in cfg.actor_rollout_ref  # verl's own tree
    assert cfg.actor_rollout_ref.rollout.name == "vllm"
    raw = OmegaConf.to_container(cfg.actor_rollout_ref.rollout.drafter, resolve=True)
    assert raw == _defaults(DrafterRunConfig)  # exactly the schema's keys and defaults


def test_yaml_keys_are_exactly_the_schema_fields() -> None:
    raw = OmegaConf.to_container(OmegaConf.load(ROOT / "configs" / "speco_trainer.yaml"))
    assert isinstance(raw, dict)
    drafter = raw["actor_rollout_ref"]["rollout"]["drafter"]

    def paths(d: dict[str, Any], prefix: str = "") -> set[str]:
        out = set()
        for k, v in d.items():
            out.add(prefix + k)
            if isinstance(v, dict) and k != "settings":
                out |= paths(v, prefix + k + ".")
        return out

    assert paths(drafter) == {p for p, _ in _field_paths(DrafterRunConfig)}


def test_overrides_reach_the_typed_config() -> None:
    cfg = compose(["actor_rollout_ref.rollout.drafter.enable=true", "actor_rollout_ref.rollout.drafter.mode=collect_only",
                   "actor_rollout_ref.rollout.drafter.feature_store.path=/tmp/store",
                   "actor_rollout_ref.rollout.drafter.caps.max_rows=5", "+actor_rollout_ref.rollout.drafter.settings.ttt_steps=2"])
    drafter = extract_drafter(cfg)
    assert (drafter.enable, drafter.mode, drafter.caps.max_rows) == (True, "collect_only", 5)
    assert drafter.feature_store.path == "/tmp/store" and drafter.settings == {"ttt_steps": 2}
    # moved out of verl's rollout section (verl builds a strict RolloutConfig from it) ...
    assert "drafter" not in cfg.actor_rollout_ref.rollout
    from verl.utils.config import omega_conf_to_dataclass

    rollout = omega_conf_to_dataclass(cfg.actor_rollout_ref.rollout)
    assert type(rollout).__name__ == "RolloutConfig"
    # ... to where the actor workers read it back, unchanged; a second extract is a no-op
    assert drafter_from_actor_rollout_ref(cfg.actor_rollout_ref) == drafter
    assert extract_drafter(cfg) == drafter


def test_drafter_section_breaks_verl_if_left_in_place() -> None:
    """Why extract_drafter exists: verl's RolloutConfig rejects the unknown `drafter` key."""
    from verl.utils.config import omega_conf_to_dataclass

    with pytest.raises(Exception, match="drafter"):
        omega_conf_to_dataclass(compose().actor_rollout_ref.rollout)


def test_unknown_drafter_key_fails_naming_it() -> None:
    with pytest.raises(ConfigCompositionException, match="drafter.enabel"):
        compose(["actor_rollout_ref.rollout.drafter.enabel=true"])
    cfg = compose(["+actor_rollout_ref.rollout.drafter.caps.max_rowz=3"])  # appended past Hydra
    with pytest.raises(DrafterConfigError, match=r"drafter\.caps: unknown key\(s\) \['max_rowz'\]"):
        extract_drafter(cfg)


def test_bad_drafter_value_fails_naming_key_and_value() -> None:
    cfg = compose(["actor_rollout_ref.rollout.drafter.schedule=sometimes"])
    with pytest.raises(DrafterConfigError, match=r"drafter\.schedule: got 'sometimes'"):
        extract_drafter(cfg)


def _eagle3_format() -> Any:
    from drafters.common.target import TargetSpec
    from drafters.registry import get_family

    spec = TargetSpec(vocab_size=96, hidden_size=64, num_hidden_layers=8, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, intermediate_size=128, rope_theta=1e4, rms_norm_eps=1e-6,
                      max_position_embeddings=512, model_type="qwen3", tie_word_embeddings=False)
    family = get_family("eagle3")
    return family.engine_format(family.resolve(family.config_cls(), spec), spec)


def test_speculative_config_from_drafter_and_conflicts() -> None:
    fmt = _eagle3_format()  # the family's engine format decides the speculative arguments
    cfg = compose(["actor_rollout_ref.rollout.drafter.enable=true",
                   "actor_rollout_ref.rollout.drafter.num_speculative_tokens=4"])
    drafter = extract_drafter(cfg)
    assert cfg.actor_rollout_ref.rollout.load_format == "dummy"  # verl's default
    kwargs = apply_speculative_config(cfg, drafter, "/drafts/v0", fmt)
    assert kwargs["speculative_config"] == {"method": "eagle3", "model": "/drafts/v0", "num_speculative_tokens": 4}
    # dummy weights would make vLLM share the target's LM head with the draft (issue 10, bug B)
    assert cfg.actor_rollout_ref.rollout.load_format == "auto"
    kept = compose(["actor_rollout_ref.rollout.drafter.enable=true", "actor_rollout_ref.rollout.load_format=safetensors"])
    apply_speculative_config(kept, extract_drafter(kept), "/drafts/v0", fmt)
    assert kept.actor_rollout_ref.rollout.load_format == "safetensors"  # a real load format is left alone
    clash = compose(["actor_rollout_ref.rollout.drafter.enable=true",
                     "+actor_rollout_ref.rollout.engine_kwargs.vllm.speculative_config.num_speculative_tokens=2"])
    with pytest.raises(DrafterConfigError, match="speculative_config.num_speculative_tokens: got 2"):
        apply_speculative_config(clash, extract_drafter(clash), "/drafts/v0", fmt)
    sg = compose(["actor_rollout_ref.rollout.name=sglang", "actor_rollout_ref.rollout.drafter.enable=true"])
    out = apply_speculative_config(sg, extract_drafter(sg), "/drafts/v0", fmt)
    assert out["speculative_algorithm"] == "EAGLE3" and out["speculative_num_steps"] == 3


def _sources_outside_config() -> str:
    files = [p for p in sorted((ROOT / "verl_speco").rglob("*.py")) if p != ROOT / "verl_speco/online/config.py"]
    return "\n".join(p.read_text() for p in files)


def _dead_fields(source: str) -> list[str]:
    return [path for path, name in _field_paths(DrafterRunConfig)
            if not re.search(rf"\.{re.escape(name)}\b", source)]


def test_every_drafter_field_is_read_outside_the_schema() -> None:
    assert _dead_fields(_sources_outside_config()) == []


def test_dead_key_scan_can_fail() -> None:
    source = re.sub(r"\.buffer_max_tokens\b", ".renamed", _sources_outside_config())
    assert _dead_fields(source) == ["buffer_max_tokens"]


def test_main_cfg_job_prints_the_composed_config(capsys: pytest.CaptureFixture[str]) -> None:
    from verl_speco.main import main

    assert main(["--config-dir", str(Path(ROOT / "configs")), "--cfg", "job",
                 "actor_rollout_ref.rollout.drafter.seed=7"]) == 0
    assert "seed: 7" in capsys.readouterr().out
    assert main(["actor_rollout_ref.rollout.drafter.nope=1"]) == 2
    assert "drafter.nope" in capsys.readouterr().err


def test_capture_source_in_a_verl_run(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """actor never plans; a family SGLang cannot serve is refused (rollout) or falls back (auto); one it
    could serve is refused naming verl's SGLang server, which returns no hidden states (auto: actor)."""
    from speco_verl_helpers import tiny_qwen3

    from verl_speco.verl_integration.trainer import speco_capture_source

    target = tmp_path / "target"
    tiny_qwen3().save_pretrained(target)
    on = {"enable": True, "mode": "collect_only"}
    eagle3 = DrafterRunConfig(**on, family="eagle3", capture_source="rollout")
    assert speco_capture_source(dataclasses.replace(eagle3, capture_source="actor"), "sglang", str(target),
                                "0.5.23") == "actor"
    with pytest.raises(DrafterConfigError, match="capture_source: got 'rollout', but .*never both"):
        speco_capture_source(eagle3, "sglang", str(target), "0.5.23")
    eagle1 = DrafterRunConfig(**on, family="eagle1", capture_source="rollout")
    with pytest.raises(DrafterConfigError, match="--enable-return-hidden-states.*SGLangHttpServer.generate"):
        speco_capture_source(eagle1, "sglang", str(target), "0.5.12")
    with caplog.at_level("WARNING"):
        assert speco_capture_source(dataclasses.replace(eagle1, capture_source="auto"), "sglang", str(target),
                                    "0.5.12") == "actor"
        assert speco_capture_source(dataclasses.replace(eagle1, capture_source="auto"), "vllm", str(target),
                                    None) == "actor"
    assert caplog.text.count("capturing from the actor") == 2 and "rollout.name=sglang, got 'vllm'" in caplog.text


def test_verls_sglang_server_asks_for_no_hidden_states() -> None:
    """The reason `speco_capture_source` gives, pinned to verl 0.9.1's source: its SGLang server's
    generate never sets return_hidden_states (when a release does, the rollout route can be wired)."""
    import importlib.util
    from importlib.metadata import version

    assert version("verl") == "0.9.1"
    spec = importlib.util.find_spec("verl.workers.rollout.sglang_rollout")  # its server imports sglang: read only
    assert spec is not None and spec.submodule_search_locations
    source = (Path(list(spec.submodule_search_locations)[0]) / "async_sglang_server.py").read_text()
    assert "GenerateReqInput(**request)" in source and "return_hidden_states" not in source
