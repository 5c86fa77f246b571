"""The GPU launchers scripts/run_qwen3_8b_eagle3_*.sh: their overrides compose with speco_trainer.

The overrides are read out of each script (the lines between `-m verl_speco.main` and `"$@"`),
shell defaults substituted (`VAR=${VAR:-default}` lines), then composed exactly as
`python -m verl_speco.main` would, the drafter section validated, and verl's own config checks
run (`validate_config`). A typo'd key makes composition fail.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException
from speco_verl_helpers import CONFIG_DIR, ROOT

from verl_speco.main import compose

SCRIPTS = sorted((ROOT / "scripts").glob("run_qwen3_8b_eagle3_*.sh"))


def script_overrides(path: Path) -> list[str]:
    text = path.read_text()
    defaults = dict(re.findall(r"^(\w+)=\$\{\w+:-(.*)\}$", text, flags=re.M))
    defaults.setdefault("HOME", "/home/user")
    body = text.split("-m verl_speco.main", 1)[1].split('"$@"', 1)[0]
    expanded = re.sub(r"\$\{?(\w+)\}?", lambda m: defaults[m.group(1)], body.replace("\\\n", " "))
    return shlex.split(expanded)


def test_both_launchers_exist() -> None:
    assert [p.name for p in SCRIPTS] == ["run_qwen3_8b_eagle3_sglang.sh", "run_qwen3_8b_eagle3_vllm.sh"]


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_launcher_overrides_compose(script: Path) -> None:
    from verl_speco.verl_integration.config_bridge import prepare_config

    overrides = script_overrides(script)
    assert len(overrides) > 20 and all("=" in o for o in overrides)
    cfg = compose(overrides, config_dir=CONFIG_DIR)
    drafter = prepare_config(cfg)  # drafter schema + verl's validate_config
    assert drafter.enable and drafter.mode == "online" and drafter.algorithm == "eagle3"
    assert cfg.actor_rollout_ref.model.path == "Qwen/Qwen3-8B"
    engine = "sglang" if "sglang" in script.name else "vllm"
    assert cfg.actor_rollout_ref.rollout.name == engine
    assert cfg.trainer.n_gpus_per_node == 8 and cfg.trainer.use_v1


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_a_typo_in_a_launcher_key_fails(script: Path) -> None:
    overrides = script_overrides(script)
    for i, o in enumerate(overrides):
        if o.startswith("actor_rollout_ref.rollout.drafter.schedule="):
            overrides[i] = o.replace(".schedule=", ".schedul=")
    with pytest.raises(ConfigCompositionException, match="drafter.schedul"):
        compose(overrides, config_dir=CONFIG_DIR)
    overrides = script_overrides(script) + ["trainer.total_epoch=1"]
    with pytest.raises(ConfigCompositionException, match="total_epoch"):
        compose(overrides, config_dir=CONFIG_DIR)
