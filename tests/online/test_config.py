"""`DrafterRunConfig.from_dict`: defaults, nested sections, unknown keys and every validate() rule."""

from __future__ import annotations

import re
from typing import Any

import pytest

from verl_speco.online.config import (
    ONLINE_OPTIM,
    CaptureCaps,
    DrafterConfigError,
    DrafterRunConfig,
    FeatureStoreSink,
)
from verl_speco.train.config import OptimConfig

PREFIX = "actor_rollout_ref.rollout.drafter."


def test_defaults_from_none_and_empty() -> None:
    for raw in (None, {}):
        cfg = DrafterRunConfig.from_dict(raw)
        assert cfg == DrafterRunConfig()
        assert (cfg.enable, cfg.family, cfg.mode, cfg.schedule) == (False, "eagle3", "online", "serial")
        assert cfg.model_path is None and cfg.settings == {} and cfg.publish_dir is None
        assert (cfg.num_speculative_tokens, cfg.collect_interval, cfg.train_interval, cfg.publish_interval) == (3, 1, 1, 1)
        assert (cfg.train_steps_per_round, cfg.train_passes_per_round) == (None, 4.0)
        assert (cfg.micro_batch_size, cfg.max_staleness) == (8, 1)
        assert cfg.capture_pass == "post_update" and cfg.fresh_samples == 0
        assert (cfg.buffer_max_tokens, cfg.seed) == (262144, 0)
        assert cfg.caps == CaptureCaps(max_rows=64, max_tokens=32768, min_response_tokens=1, max_seq_len=4096)
        assert cfg.optim == OptimConfig(lr=1e-3, betas=[0.9, 0.95], weight_decay=0.0, warmup_steps=0, grad_clip=1.0)
        assert cfg.feature_store == FeatureStoreSink(path=None, hidden_dtype="bfloat16", flush_samples=256)


def test_default_factories_are_not_shared() -> None:
    a, b = DrafterRunConfig.from_dict({}), DrafterRunConfig.from_dict({})
    a.optim.betas.append(0.5)
    a.settings["x"] = 1
    assert b.optim.betas == [0.9, 0.95] and b.settings == {}


def test_nested_sections_and_top_level_values() -> None:
    raw = {"enable": True, "mode": "collect_only", "schedule": "overlap", "seed": 7,
           "settings": {"ttt_steps": 2, "num_layers": 1},
           "caps": {"max_rows": 5, "max_seq_len": 100},
           "optim": {"lr": 3e-3, "betas": [0.8, 0.9], "warmup_steps": 4},
           "feature_store": {"path": "/tmp/store", "hidden_dtype": "float32"}}
    cfg = DrafterRunConfig.from_dict(raw)
    assert (cfg.enable, cfg.mode, cfg.schedule, cfg.seed) == (True, "collect_only", "overlap", 7)
    assert cfg.settings == {"ttt_steps": 2, "num_layers": 1}
    assert isinstance(cfg.caps, CaptureCaps) and isinstance(cfg.optim, OptimConfig)
    # given keys replaced, the others of the section keep their defaults
    assert cfg.caps == CaptureCaps(max_rows=5, max_tokens=32768, min_response_tokens=1, max_seq_len=100)
    assert cfg.optim == OptimConfig(lr=3e-3, betas=[0.8, 0.9], weight_decay=0.0, warmup_steps=4, grad_clip=1.0)
    assert cfg.feature_store == FeatureStoreSink(path="/tmp/store", hidden_dtype="float32", flush_samples=256)
    assert raw["caps"] == {"max_rows": 5, "max_seq_len": 100}  # the input is not modified


@pytest.mark.parametrize(("raw", "where", "key", "valid"), [
    ({"enabel": True}, "drafter", "enabel", ["caps", "enable", "family", "mode", "optim", "settings"]),
    ({"caps": {"max_rowz": 3}}, "drafter.caps", "max_rowz",
     ["max_rows", "max_seq_len", "max_tokens", "min_response_tokens"]),
    ({"optim": {"learning_rate": 1.0}}, "drafter.optim", "learning_rate", ["betas", "grad_clip", "lr"]),
    ({"feature_store": {"dir": "/x"}}, "drafter.feature_store", "dir", ["flush_samples", "hidden_dtype", "hidden_encoding", "path"]),
])
def test_unknown_key_names_it_and_lists_valid_keys(raw: dict[str, Any], where: str, key: str,
                                                   valid: list[str]) -> None:
    with pytest.raises(DrafterConfigError) as e:
        DrafterRunConfig.from_dict(raw)
    msg = str(e.value)
    assert f"actor_rollout_ref.rollout.{where}:" in msg
    assert repr(key) in msg
    listed = msg.split("valid keys are", 1)[1]
    for name in valid:
        assert repr(name) in listed, (name, msg)
    assert repr(key) not in listed


def test_unknown_keys_reported_all_sorted() -> None:
    with pytest.raises(DrafterConfigError, match=re.escape("unknown key(s) ['aaa', 'zzz']")):
        DrafterRunConfig.from_dict({"zzz": 1, "aaa": 2, "seed": 3})


def test_nested_section_must_be_a_mapping() -> None:
    with pytest.raises(DrafterConfigError, match=re.escape(f"{PREFIX}caps: got 5, expected a mapping")):
        DrafterRunConfig.from_dict({"caps": 5})


def test_config_error_is_a_value_error() -> None:
    assert issubclass(DrafterConfigError, ValueError)


BAD_VALUES: list[tuple[dict[str, Any], str, str, str]] = [
    ({"mode": "train"}, "mode", "'train'", "one of ('online', 'collect_only', 'offline')"),
    ({"schedule": "async"}, "schedule", "'async'", "one of ('serial', 'overlap')"),
    *[({k: 0}, k, "0", "an integer >= 1") for k in (
        "collect_interval", "train_interval", "publish_interval",
        "micro_batch_size", "num_speculative_tokens", "buffer_max_tokens")],
    *[({"train_steps_per_round": v}, "train_steps_per_round", repr(v),
       "an integer >= 1, or null (derived from train_passes_per_round)") for v in (0, 2.5, True)],
    *[({"train_passes_per_round": v}, "train_passes_per_round", repr(v), "a finite number > 0")
      for v in (0, -1.0, float("inf"), "4")],
    ({"max_staleness": -1}, "max_staleness", "-1", "an integer >= 0"),
    *[({"caps": {k: 0}}, f"caps.{k}", "0", "an integer >= 1") for k in (
        "max_rows", "max_tokens", "min_response_tokens", "max_seq_len")],
    # OptimConfig.problems(), shared with the standalone trainer
    ({"optim": {"lr": 0.0}}, "optim.lr", "0.0", "> 0"),
    ({"optim": {"lr": -1e-3}}, "optim.lr", "-0.001", "> 0"),
    ({"optim": {"betas": [0.9]}}, "optim.betas", "[0.9]", "two values in [0, 1)"),
    ({"optim": {"betas": [0.9, 0.95, 0.99]}}, "optim.betas", "[0.9, 0.95, 0.99]", "two values in [0, 1)"),
    ({"optim": {"betas": [0.9, 1.0]}}, "optim.betas", "[0.9, 1.0]", "two values in [0, 1)"),
    ({"optim": {"warmup_steps": -1}}, "optim.warmup_steps", "-1", ">= 0"),
    ({"optim": {"denominators": "both"}}, "optim.denominators", "'both'", "retain or prepass"),
    # valid OptimConfig values the online drafter cannot honour
    ({"optim": {"schedule": "cosine"}}, "optim.schedule", "'cosine'", ONLINE_OPTIM["schedule"][1]),
    ({"optim": {"warmup_ratio": 0.1}}, "optim.warmup_ratio", "0.1", ONLINE_OPTIM["warmup_ratio"][1]),
    ({"optim": {"grad_accum": 2}}, "optim.grad_accum", "2", ONLINE_OPTIM["grad_accum"][1]),
    ({"enable": True, "mode": "collect_only"}, "feature_store.path", "None",
     "a store directory in collect_only mode"),
    ({"heldout_baseline": True, "mode": "offline"}, "heldout_baseline", "True",
     "false unless mode=online (it compares the served draft with the initial one)"),
    ({"enable": True, "mode": "collect_only", "feature_store": {"path": ""}}, "feature_store.path", "''",
     "a store directory in collect_only mode"),
    *[({"fresh_samples": v}, "fresh_samples", repr(v), "an integer >= 0 (0: off)") for v in (-1, 2.0, True)],
    *[({"enable": True, "fresh_samples": 4, **other}, "fresh_samples", "4",
       f"0 with mode={mode}, schedule={schedule}, capture_source={source} (fresh samples train the round that "
       "blocks the step: mode=online, schedule=serial, capture_source=actor)")
      for other, mode, schedule, source in (
          ({"schedule": "overlap"}, "online", "overlap", "actor"),
          ({"capture_source": "auto"}, "online", "serial", "auto"),
          ({"mode": "collect_only", "feature_store": {"path": "/s"}}, "collect_only", "serial", "actor"))],
]


@pytest.mark.parametrize(("raw", "key", "value", "expected"), BAD_VALUES, ids=[b[1] + "=" + b[2] for b in BAD_VALUES])
def test_validate_names_key_value_and_expectation(raw: dict[str, Any], key: str, value: str, expected: str) -> None:
    with pytest.raises(DrafterConfigError) as e:
        DrafterRunConfig.from_dict(raw)
    assert str(e.value) == f"{PREFIX}{key}: got {value}, expected {expected}"


@pytest.mark.parametrize("raw", [
    {"max_staleness": 0},
    {"caps": {"max_rows": 1, "max_tokens": 1, "min_response_tokens": 1, "max_seq_len": 1}},
    {"mode": "collect_only"},  # not enabled: no store needed
    {"enable": True, "mode": "collect_only", "feature_store": {"path": "/x"}},
    {"enable": True, "mode": "offline"},
    {"enable": True, "fresh_samples": 4},
    {"fresh_samples": 4, "schedule": "overlap"},  # not enabled: nothing runs
])
def test_boundary_values_pass(raw: dict[str, Any]) -> None:
    DrafterRunConfig.from_dict(raw)


def test_validate_on_a_directly_built_config() -> None:
    cfg = DrafterRunConfig(micro_batch_size=0)
    with pytest.raises(DrafterConfigError, match=re.escape(f"{PREFIX}micro_batch_size: got 0")):
        cfg.validate()
    ok = DrafterRunConfig()
    assert ok.validate() is ok
