"""Every YAML under configs/ composes against the typed schema; bad keys and values fail by name."""

from __future__ import annotations

import dataclasses

import pytest

from drafters import get_family
from verl_speco.train.compose import compose_raw, default_config_dir, load_config, to_trainer_config
from verl_speco.train.config import ConfigError, OptimConfig, TrainerConfig, build_family_config

CONFIG_DIR = default_config_dir()
PATHS = ["target.path=/nonexistent/target", "data.store=/nonexistent/store"]


# RL-entry configs compose verl's ppo_trainer, not the trainer schema: tests/verl/test_speco_config.py
RL_CONFIGS = ("speco_trainer.yaml", "speco_cpu/grpo_embedded.yaml")  # composed by tests/verl


def _all_yaml() -> list[str]:
    """Every trainer YAML (every YAML under configs/ except the RL-entry ones)."""
    return sorted(str(p.relative_to(CONFIG_DIR)) for p in CONFIG_DIR.rglob("*.yaml")
                  if str(p.relative_to(CONFIG_DIR)) not in RL_CONFIGS)


def test_rl_entry_configs_exist() -> None:
    for rel in RL_CONFIGS:
        assert (CONFIG_DIR / rel).is_file()


def _compose(rel: str) -> TrainerConfig:
    """Top-level files compose by name; group files `g/name.yaml` as draft_trainer + `g=name`."""
    parts = rel.removesuffix(".yaml").split("/")
    if len(parts) == 1:
        return load_config(PATHS, config_name=parts[0])
    return load_config([*PATHS, f"{'/'.join(parts[:-1])}={parts[-1]}"])


def test_configs_dir_has_the_expected_files() -> None:
    found = _all_yaml()
    for rel in ("draft_trainer.yaml", "drafter/eagle3.yaml", "preset/quickstart_eagle3.yaml",
                "preset/qwen3_8b_eagle3.yaml"):
        assert rel in found


@pytest.mark.parametrize("rel", _all_yaml())
def test_every_yaml_composes_and_validates(rel: str) -> None:
    cfg = _compose(rel)
    assert isinstance(cfg, TrainerConfig)
    family = get_family(cfg.drafter.family)
    fam_cfg = build_family_config(family.config_cls, dict(cfg.drafter.settings), cfg.drafter.family)
    assert isinstance(fam_cfg, family.config_cls)


def test_presets_set_their_recipes() -> None:
    q = load_config([*PATHS, "preset=qwen3_8b_eagle3"])
    # docs/design/algorithms.md section 3, DeepSpec retrain: lr 6e-4, warmup 4 %, wd 0, ttt 7, decay 0.8, grad norm 1.0
    assert (q.optim.lr, q.optim.warmup_ratio, q.optim.weight_decay, q.optim.grad_clip) == (6e-4, 0.04, 0.0, 1.0)
    assert (q.drafter.settings["ttt_steps"], q.drafter.settings["ttt_decay"], q.data.max_seq_len) == (7, 0.8, 4096)
    assert list(q.optim.betas) == [0.9, 0.95]
    assert 8 * q.data.micro_batch_size * q.optim.grad_accum == 512  # global batch on 8 GPUs
    quick = load_config([*PATHS, "preset=quickstart_eagle3", "run.total_steps=7"])
    assert quick.run.device == "cpu" and quick.run.total_steps == 7  # command line wins over the preset


def test_unknown_key_fails_loudly() -> None:
    with pytest.raises(ConfigError, match=r"unknown trainer setting 'optim\.lrr=1': expected one of optim\.lr, "):
        load_config([*PATHS, "optim.lrr=1"])
    with pytest.raises(ConfigError, match=r"unknown trainer setting 'optim\.lrr': expected one of optim\.lr, "):
        load_config([*PATHS, "+optim.lrr=1"])
    with pytest.raises(ConfigError, match=r"'drafter\.settings\.ttt=3': .* expected \+drafter\.settings\.ttt=\.\.\."):
        load_config([*PATHS, "drafter.settings.ttt=3"])


@pytest.mark.parametrize(("override", "message"), [
    ("run.total_steps=many", "run.total_steps='many': expected an integer ("),
    ("data.token_budget=lots", "data.token_budget='lots': expected an integer or null ("),
    ("data.shuffle=maybe", "data.shuffle='maybe': expected true or false ("),
    ("optim.betas=3", "optim.betas=3: expected a list of floats ("),
    ("preset=nope", "preset=nope: no such config; expected one of "
     + ", ".join(sorted(p.stem for p in (CONFIG_DIR / "preset").glob("*.yaml")))),
])
def test_type_errors_fail_by_name(override: str, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_config([*PATHS, override])
    assert str(err.value).startswith(message)


@pytest.mark.parametrize(("override", "key"), [
    ("optim.schedule=exp", "optim.schedule"), ("run.device=tpu", "run.device"),
    ("run.dtype=int8", "run.dtype"), ("optim.betas=[0.9]", "optim.betas"), ("optim.grad_accum=0", "optim.grad_accum"),
    ("data.eval_fraction=1.0", "data.eval_fraction"), ("dist.backend=mpi", "dist.backend"),
])
def test_bad_values_name_the_field(override: str, key: str) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        load_config([*PATHS, override])


def test_one_optim_section_for_both_trainers() -> None:
    """`OptimConfig` is the standalone trainer's `optim` and the online drafter's, each with its own
    schedule default (cosine / constant); its validation names the field, the value and what was expected."""
    from verl_speco.online.config import DrafterConfigError, DrafterRunConfig

    assert type(TrainerConfig().optim) is type(DrafterRunConfig().optim) is OptimConfig
    assert (TrainerConfig().optim.schedule, DrafterRunConfig().optim.schedule) == ("cosine", "constant")
    assert {f.name for f in dataclasses.fields(OptimConfig)} >= {"lr", "betas", "warmup_ratio", "denominators"}
    assert OptimConfig(lr=0.0, grad_accum=0).problems() == [("lr", 0.0, "> 0"), ("grad_accum", 0, ">= 1")]
    with pytest.raises(ConfigError, match=r"^optim\.lr=0\.0: expected > 0$"):
        load_config([*PATHS, "optim.lr=0.0"])
    with pytest.raises(DrafterConfigError, match=r"^actor_rollout_ref\.rollout\.drafter\.optim\.lr: got 0\.0, expected > 0$"):
        DrafterRunConfig.from_dict({"optim": {"lr": 0.0}})


def test_missing_mandatory_paths_are_named() -> None:
    with pytest.raises(ConfigError, match=r"data\.store, target\.path not set: expected data\.store=\.\.\."):
        to_trainer_config(compose_raw([]))


def test_family_settings_are_validated_by_the_family() -> None:
    family = get_family("eagle3")
    with pytest.raises(ConfigError, match="ttt_stepz"):
        build_family_config(family.config_cls, {"ttt_stepz": 3}, "eagle3")
    with pytest.raises(ConfigError, match="ttt_steps"):
        build_family_config(family.config_cls, {"ttt_steps": 0}, "eagle3")


def test_schema_rejects_unknown_top_level_key() -> None:
    with pytest.raises(ConfigError, match="trainer"):
        load_config([*PATHS, "+trainer.foo=1"])
