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


def test_rollout_context_leaves_the_drafter_room(caplog: pytest.LogCaptureFixture) -> None:
    """A user max_model_len of prompt + response would make vLLM skip the drafter batch-wide on the
    last steps of every capped response: raised to prompt + response + 2k; verl's default (None) and
    a roomy value are left alone."""
    fmt = _eagle3_format()
    base = ["actor_rollout_ref.rollout.drafter.enable=true", "actor_rollout_ref.rollout.drafter.num_speculative_tokens=3",
            "data.max_prompt_length=100", "data.max_response_length=60"]
    tight = compose([*base, "actor_rollout_ref.rollout.max_model_len=160"])
    apply_speculative_config(tight, extract_drafter(tight), "/drafts/v0", fmt)
    assert tight.actor_rollout_ref.rollout.max_model_len == 100 + 60 + 2 * 3
    assert "max_model_len: 160 raised to 166" in caplog.text
    roomy = compose([*base, "actor_rollout_ref.rollout.max_model_len=4096"])
    apply_speculative_config(roomy, extract_drafter(roomy), "/drafts/v0", fmt)
    assert roomy.actor_rollout_ref.rollout.max_model_len == 4096
    default = compose(base)
    apply_speculative_config(default, extract_drafter(default), "/drafts/v0", fmt)
    assert default.actor_rollout_ref.rollout.max_model_len is None
    off = compose(["data.max_prompt_length=100", "data.max_response_length=60", "actor_rollout_ref.rollout.max_model_len=160"])
    assert off.actor_rollout_ref.rollout.max_model_len == 160  # no drafter: nothing applied


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
    can serve is armed: SGLang's capture flags in engine_kwargs.sglang, our agent loop the default
    through a complete agent_loop_config_path file (online: only with capture_pass=old_logprob)."""
    from omegaconf import OmegaConf
    from speco_verl_helpers import tiny_qwen3

    from verl_speco.verl_integration.rollout_rows import arm_rollout_capture
    from verl_speco.verl_integration.sglang_agent_loop import AGENT_LOOP_NAME
    from verl_speco.verl_integration.trainer_setup import speco_capture_source

    target = tmp_path / "target"
    tiny_qwen3().save_pretrained(target)
    on = {"enable": True, "mode": "collect_only"}
    eagle3 = DrafterRunConfig(**on, family="eagle3", capture_source="rollout")
    assert speco_capture_source(dataclasses.replace(eagle3, capture_source="actor"), "sglang", str(target),
                                "0.5.23") is None
    with pytest.raises(DrafterConfigError, match="capture_source: got 'rollout', but .*never both"):
        speco_capture_source(eagle3, "sglang", str(target), "0.5.23")
    eagle1 = DrafterRunConfig(**on, family="eagle1", capture_source="rollout", publish_dir=str(tmp_path / "pub"))
    plan = speco_capture_source(eagle1, "sglang", str(target), "0.5.12")
    assert plan is not None and plan.mode == "plain"
    with pytest.raises(DrafterConfigError, match="capture_pass='post_update' needs the updated actor"):
        speco_capture_source(dataclasses.replace(eagle1, mode="online"), "sglang", str(target), "0.5.12")
    assert speco_capture_source(dataclasses.replace(eagle1, mode="online", capture_pass="old_logprob"), "sglang",
                                str(target), "0.5.12") is not None
    with caplog.at_level("WARNING"):
        assert speco_capture_source(dataclasses.replace(eagle1, capture_source="auto"), "vllm", str(target),
                                    None) is None
        assert speco_capture_source(dataclasses.replace(eagle3, capture_source="auto"), "sglang", str(target),
                                    "0.5.23") is None
    assert caplog.text.count("capturing from the actor") == 2 and "rollout.name=sglang, got 'vllm'" in caplog.text

    config = OmegaConf.create({"actor_rollout_ref": {"rollout": {
        "engine_kwargs": {"vllm": {}, "sglang": {"mem_fraction_static": 0.5}},
        "agent": {"default_agent_loop": "single_turn_agent", "agent_loop_config_path": None}}}})
    capture = arm_rollout_capture(config, eagle1, plan, 64)
    rollout = config.actor_rollout_ref.rollout
    assert dict(rollout.engine_kwargs.sglang) == {"mem_fraction_static": 0.5, "enable_return_hidden_states": True}
    assert rollout.agent.default_agent_loop == AGENT_LOOP_NAME and capture.hidden_size == 64
    (entry,) = OmegaConf.load(rollout.agent.agent_loop_config_path)
    assert Path(rollout.agent.agent_loop_config_path).parent == tmp_path / "pub"
    assert entry.name == AGENT_LOOP_NAME and entry._target_.endswith("SpecoSGLangCaptureAgentLoop")
    assert entry.capture_plan.mode == "plain" and entry.capture_hidden_dtype == "bfloat16"
    assert not list((tmp_path / "pub").glob("*.tmp"))


def _verl_source(relpath: str) -> str:
    import importlib.util

    spec = importlib.util.find_spec("verl")
    assert spec is not None and spec.submodule_search_locations
    return (Path(list(spec.submodule_search_locations)[0]) / relpath).read_text()


def test_verl_internals_the_capture_loop_uses() -> None:
    """What `sglang_agent_loop` relies on, pinned to verl 0.9.1's source (its SGLang server imports sglang:
    read, not imported): engine_kwargs.sglang reach ServerArgs; the server's own generate never asks
    for hidden states (why our loop exists); the router keys replicas by their HTTP address; the client
    internals we call; agent loops built from `agent_loop_config_path` by `_target_` with extra kwargs;
    the single-turn loop calls `server_manager.generate`; TQ tags read extra_fields' global steps."""
    import ast
    from importlib.metadata import version

    from verl_speco.verl_integration.sglang_agent_loop import VERL_RELEASES

    assert version("verl") in VERL_RELEASES
    server = _verl_source("workers/rollout/sglang_rollout/async_sglang_server.py")
    assert "**engine_kwargs," in server and "server_args = ServerArgs(**args)" in server
    assert "GenerateReqInput(**request)" in server and "return_hidden_states" not in server
    assert 'else f"{server_address}:{server_port}"' in server  # SGLangReplica._server_address
    llm = _verl_source("workers/rollout/llm_server.py")
    assert "servers=dict(zip(self.server_addresses, self.server_handles, strict=True))" in llm
    tree = ast.parse(llm)
    (client,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "LLMServerClient"]
    methods = {n.name: n for n in client.body if isinstance(n, ast.AsyncFunctionDef | ast.FunctionDef)}
    assert isinstance(methods["_acquire_server"], ast.AsyncFunctionDef)
    assert [a.arg for a in methods["_acquire_server"].args.args] == ["self", "request_id"]
    assert [a.arg for a in methods["_release_server"].args.args] == ["self", "server_id", "request_id"]
    loop = _verl_source("experimental/agent_loop/agent_loop.py")
    assert "_agent_loop_registry[agent_loop_config.name] = agent_loop_config" in loop
    assert "hydra.utils.instantiate(\n                config=agent_loop_config," in loop
    assert 'default_agent_loop = config.agent.default_agent_loop' in loop
    single = _verl_source("experimental/agent_loop/single_turn_agent_loop.py")
    assert "await self.server_manager.generate(" in single and "extra_fields=output.extra_fields" in single
    tq = _verl_source("trainer/ppo/v1/agent_loop_tq.py")
    assert '"min_global_steps": field["extra_fields"].get("min_global_steps")' in tq


def _calibration_file(path: Path) -> Path:
    from verl_speco.speculation.cost_model import StepTimes
    from verl_speco.speculation.plan import Calibration

    # a draft step of k costs 1 + 0.5 k plain steps at batch 1, 1 + 1.5 k at batch 8; rates 0.9, 0.8, 0.7, 0.6
    times = StepTimes((1, 8), (0.010, 0.020), tuple((0.010 + 0.005 * k, 0.020 + 0.030 * k) for k in range(5)),
                      (0.05, 0.2), (0.05, 0.2))
    return Calibration(times, (0.9, 0.8, 0.7, 0.6), max_num_seqs=8).write(path / "calibration.json")


def test_speculation_auto_applies_the_planned_schedule(tmp_path: Path) -> None:
    fmt = _eagle3_format()
    cal = _calibration_file(tmp_path)
    cfg = compose(["actor_rollout_ref.rollout.drafter.enable=true",
                   f"actor_rollout_ref.rollout.drafter.speculation_calibration={cal}"])
    spec = apply_speculative_config(cfg, extract_drafter(cfg), "/drafts/v0", fmt)["speculative_config"]
    # capped at num_speculative_tokens=3 (the 4th rate is not used); batch 1: k=3 gives 3.4 tokens in 2.5
    # plain steps; batch 8: every k loses to k=0 (k=1: 1.9 tokens in 2.5 steps)
    assert spec["num_speculative_tokens"] == 3
    schedule = spec["num_speculative_tokens_per_batch_size"]
    assert schedule[0][:2] == [1, 1] and schedule[0][2] == 3 and schedule[-1] == [schedule[-1][0], 8, 0]
    fixed = compose(["actor_rollout_ref.rollout.drafter.enable=true", "actor_rollout_ref.rollout.drafter.speculation=fixed"])
    assert "num_speculative_tokens_per_batch_size" not in apply_speculative_config(
        fixed, extract_drafter(fixed), "/drafts/v0", fmt)["speculative_config"]


def test_speculation_refusals_name_the_setting(tmp_path: Path) -> None:
    from verl_speco.speculation.apply import resolve_mode

    fmt = _eagle3_format()
    sg = compose(["actor_rollout_ref.rollout.name=sglang", "actor_rollout_ref.rollout.drafter.enable=true",
                  "actor_rollout_ref.rollout.drafter.speculation=auto"])
    with pytest.raises(DrafterConfigError, match=r"drafter.speculation: got 'auto', but sglang"):
        apply_speculative_config(sg, extract_drafter(sg), "/drafts/v0", fmt)
    assert resolve_mode(None, "sglang", "0.5.12") == "fixed" and resolve_mode(None, "vllm", "0.32.0") == "auto"
    assert resolve_mode(None, "vllm", "0.24.0") == "fixed"
    with pytest.raises(DrafterConfigError, match="vLLM 0.24.0: its speculative_config has no"):
        resolve_mode("auto", "vllm", "0.24.0")
    with pytest.raises(DrafterConfigError, match="speculation_calibration: got"):
        DrafterRunConfig.from_dict({"speculation": "fixed", "speculation_calibration": "/x.json"})
    with pytest.raises(DrafterConfigError, match="heldout_baseline: got True, expected false with a speculation_cal"):
        DrafterRunConfig.from_dict({"heldout_baseline": True, "speculation_calibration": "/x.json"})
    with pytest.raises(DrafterConfigError, match="speculation: got 'sometimes'"):
        DrafterRunConfig.from_dict({"speculation": "sometimes"})
    (tmp_path / "bad.json").write_text('{"format": "something else"}')
    bad = compose(["actor_rollout_ref.rollout.drafter.enable=true",
                   f"actor_rollout_ref.rollout.drafter.speculation_calibration={tmp_path / 'bad.json'}"])
    with pytest.raises(DrafterConfigError, match="speculation_calibration: .*format: got 'something else'"):
        apply_speculative_config(bad, extract_drafter(bad), "/drafts/v0", fmt)


def test_installed_vllm_takes_the_schedule_field() -> None:
    """The releases `SCHEDULE_VLLM` names have the field; the installed vLLM is one of them."""
    import dataclasses as dc

    from vllm.config.speculative import SpeculativeConfig

    from verl_speco.deploy.engine_check import installed_engine_version
    from verl_speco.deploy.versions import base_version
    from verl_speco.speculation.apply import SCHEDULE_VLLM

    assert base_version(str(installed_engine_version("vllm"))) in SCHEDULE_VLLM
    assert "num_speculative_tokens_per_batch_size" in {f.name for f in dc.fields(SpeculativeConfig)}
