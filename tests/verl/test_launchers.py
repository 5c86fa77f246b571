"""The GPU launcher scripts/run_qwen3_8b_eagle3.sh: its overrides compose with speco_trainer, per engine.

The overrides are read out of the script (the lines between `-m verl_speco.main` and `"$@"`),
shell defaults substituted (`VAR=${VAR:-default}` lines, the environment given first), then composed exactly as
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

SCRIPT = ROOT / "scripts" / "run_qwen3_8b_eagle3.sh"
ENGINES = ("vllm", "sglang")


def script_overrides(path: Path, env: dict[str, str] | None = None) -> list[str]:
    text = path.read_text()
    values = {"HOME": "/home/user", **(env or {})}
    for name, default in re.findall(r"^(\w+)=\$\{\w+:-(.*)\}$", text, flags=re.M):
        values.setdefault(name, re.sub(r"\$\{?(\w+)\}?", lambda m: values[m.group(1)], default))
    body = text.split("-m verl_speco.main", 1)[1].split('"$@"', 1)[0]
    expanded = re.sub(r"\$\{?(\w+)\}?", lambda m: values[m.group(1)], body.replace("\\\n", " "))
    return shlex.split(expanded)


def test_one_launcher_for_both_engines() -> None:
    assert sorted(p.name for p in (ROOT / "scripts").glob("run_qwen3_8b*.sh")) == [SCRIPT.name]
    assert 'vllm|sglang) ;;' in SCRIPT.read_text()  # any other ENGINE exits 2 before running


@pytest.mark.parametrize("engine", ENGINES)
def test_launcher_overrides_compose(engine: str) -> None:
    from verl_speco.verl_integration.config_bridge import prepare_config

    overrides = script_overrides(SCRIPT, {"ENGINE": engine})
    assert len(overrides) > 20 and all("=" in o for o in overrides)
    cfg = compose(overrides, config_dir=CONFIG_DIR)
    drafter = prepare_config(cfg)  # drafter schema + verl's validate_config
    assert drafter.enable and drafter.mode == "online" and drafter.algorithm == "eagle3"
    assert drafter.capture_pass == "post_update" and drafter.schedule == "overlap"
    assert drafter.num_workers == 2 and drafter.num_gpus == 1.0
    assert drafter.publish_dir == f"/dev/shm/verl_speco/qwen3_8b_eagle3_{engine}"
    assert cfg.actor_rollout_ref.model.path == "Qwen/Qwen3-8B"
    assert cfg.actor_rollout_ref.rollout.name == engine
    assert cfg.trainer.experiment_name == f"qwen3_8b_grpo_eagle3_{engine}"
    assert cfg.trainer.n_gpus_per_node == 6 and cfg.trainer.use_v1


@pytest.mark.parametrize("engine", ENGINES)
def test_a_typo_in_a_launcher_key_fails(engine: str) -> None:
    script = SCRIPT
    overrides = script_overrides(script, {"ENGINE": engine})
    for i, o in enumerate(overrides):
        if o.startswith("actor_rollout_ref.rollout.drafter.schedule="):
            overrides[i] = o.replace(".schedule=", ".schedul=")
    with pytest.raises(ConfigCompositionException, match="drafter.schedul"):
        compose(overrides, config_dir=CONFIG_DIR)
    overrides = script_overrides(script, {"ENGINE": engine}) + ["trainer.total_epoch=1"]
    with pytest.raises(ConfigCompositionException, match="total_epoch"):
        compose(overrides, config_dir=CONFIG_DIR)
