"""Engine settings per device: `vllm_engine.build_llm` (what `verl-speco-collect --engine vllm` and the
evaluation serve with) runs float32, eager, 8 sequences on the CPU, exactly as before; on a GPU or an
NPU bfloat16 with the engine's graphs and vLLM's own batch size; each setting can be overridden.

No engine starts: `vllm.LLM` is replaced by a recorder of its keyword arguments, and a GPU or NPU by
a replaced `accelerator_type`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from verl_speco.engines import vllm_engine
from verl_speco.engines.vllm_engine import engine_settings

CPU = {"dtype": "float32", "enforce_eager": True, "max_num_seqs": 8}
ACCELERATOR = {"dtype": "bfloat16", "enforce_eager": False}


class _Recorded(Exception):
    pass


@pytest.fixture
def llm_kwargs(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """What each `vllm.LLM(...)` would have been built with."""
    import vllm

    seen: list[dict[str, Any]] = []

    def record(**kwargs: Any) -> str:
        seen.append(kwargs)
        return "llm"

    monkeypatch.setattr(vllm, "LLM", record)
    return seen


def test_the_settings_per_device_and_their_overrides() -> None:
    assert engine_settings("cpu") == CPU
    assert engine_settings("cuda") == engine_settings("npu") == ACCELERATOR  # max_num_seqs: vLLM's own
    assert engine_settings("cuda", max_num_seqs=64) == {**ACCELERATOR, "max_num_seqs": 64}
    assert engine_settings("cuda", dtype="float16", enforce_eager=True) == {"dtype": "float16", "enforce_eager": True}
    assert engine_settings("cpu", enforce_eager=False, dtype="bfloat16") == {**CPU, "enforce_eager": False,
                                                                             "dtype": "bfloat16"}
    with pytest.raises(ValueError, match="dtype: got 'fp16', expected one of auto, bfloat16, float16, float32"):
        engine_settings("cuda", dtype="fp16")
    with pytest.raises(ValueError, match="max_num_seqs: got 0, expected an integer >= 1"):
        engine_settings("cpu", max_num_seqs=0)
    with pytest.raises(ValueError, match="device type: got 'tpu'"):
        engine_settings("tpu")


def test_build_llm_on_the_cpu_is_what_it_was(llm_kwargs: list[dict[str, Any]], tmp_path: Path) -> None:
    assert vllm_engine.accelerator_type() == "cpu"
    vllm_engine.build_llm(tmp_path)
    assert llm_kwargs == [{"model": str(tmp_path), "tokenizer": str(tmp_path), "dtype": "float32",
                           "max_model_len": 512, "max_num_seqs": 8, "seed": 0, "enforce_eager": True,
                           "disable_log_stats": False, "speculative_config": None}]


@pytest.mark.parametrize("device", ["cuda", "npu"])
def test_build_llm_off_the_cpu_runs_bf16_with_graphs(llm_kwargs: list[dict[str, Any]], tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch, device: str) -> None:
    monkeypatch.setattr(vllm_engine, "accelerator_type", lambda: device)
    vllm_engine.build_llm(tmp_path, tmp_path / "draft", method="eagle3", num_speculative_tokens=3)
    vllm_engine.build_llm(tmp_path, dtype="float16", enforce_eager=True, max_num_seqs=128, max_model_len=4096)
    first, second = llm_kwargs
    assert (first["dtype"], first["enforce_eager"], "max_num_seqs" in first) == ("bfloat16", False, False)
    assert first["speculative_config"] == {"method": "eagle3", "num_speculative_tokens": 3,
                                           "model": str(tmp_path / "draft")}
    assert {k: second[k] for k in ("dtype", "enforce_eager", "max_num_seqs", "max_model_len")} == \
        {"dtype": "float16", "enforce_eager": True, "max_num_seqs": 128, "max_model_len": 4096}


@pytest.mark.parametrize(("device", "given", "expected"), [
    ("cpu", {}, {"max_num_seqs": 32, "dtype": None, "enforce_eager": None}),  # as before: 32 at once
    ("cuda", {}, {"max_num_seqs": None, "dtype": None, "enforce_eager": None}),  # build_llm's device defaults
    ("cuda", {"max_num_seqs": 256, "dtype": "float16", "enforce_eager": True},
     {"max_num_seqs": 256, "dtype": "float16", "enforce_eager": True}),
])
def test_collect_generation_passes_its_settings(monkeypatch: pytest.MonkeyPatch, device: str, given: dict[str, Any],
                                                expected: dict[str, Any]) -> None:
    from verl_speco import device as device_module
    from verl_speco.capture import generate
    from verl_speco.cpu_port.env import IN_PROCESS_VLLM_ENV

    for key, value in IN_PROCESS_VLLM_ENV.items():  # what generate_responses_vllm sets: restored after the test
        monkeypatch.setenv(key, value)
    seen: list[dict[str, Any]] = []

    def build_llm(*args: Any, **kwargs: Any) -> None:
        seen.append(kwargs)
        raise _Recorded

    monkeypatch.setattr(vllm_engine, "build_llm", build_llm)
    monkeypatch.setattr(device_module, "accelerator_type", lambda: device)
    with pytest.raises(_Recorded):
        generate.generate_responses_vllm("unused", [[1, 2, 3]], end_ids=[0], max_new_tokens=4, **given)
    assert {k: seen[0][k] for k in expected} == expected


def test_evaluation_passes_engine_options_to_every_engine(monkeypatch: pytest.MonkeyPatch) -> None:
    from verl_speco.evaluation import EvalPrompts, vllm_acceptance

    seen: list[dict[str, Any]] = []

    def build_llm(*args: Any, **kwargs: Any) -> None:
        seen.append(kwargs)
        raise _Recorded

    monkeypatch.setattr(vllm_engine, "build_llm", build_llm)
    with pytest.raises(_Recorded):
        vllm_acceptance("unused", {}, EvalPrompts([[1, 2]], 0), 3, 4, engine_options={"dtype": "bfloat16"})
    assert seen[0]["dtype"] == "bfloat16" and "enforce_eager" not in seen[0]
    with pytest.raises(ValueError, match=r"engine_options: got \['tp'\]"):
        vllm_acceptance("unused", {}, EvalPrompts([[1, 2]], 0), 3, 4, engine_options={"tp": 2})
