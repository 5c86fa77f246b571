"""verl-speco: verl's PPO with online drafter co-training (`python -m verl_speco.main` / `verl-speco`).

The config is `configs/speco_trainer.yaml`: verl's own `ppo_trainer` (found through the Hydra
searchpath `pkg://verl.trainer.config`) plus the drafter section
`actor_rollout_ref.rollout.drafter.*`. Arguments are Hydra overrides, exactly as for
`python -m verl.trainer.main_ppo`:

    verl-speco data.train_files=train.parquet data.val_files=val.parquet \\
        actor_rollout_ref.model.path=Qwen/Qwen3-8B actor_rollout_ref.rollout.name=vllm \\
        actor_rollout_ref.rollout.drafter.enable=true actor_rollout_ref.rollout.drafter.mode=online

`--cfg job` prints the composed config and exits; a bad drafter key or value exits 2 naming it."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

CONFIG_NAME = "speco_trainer"


def compose(overrides: Sequence[str] = (), config_name: str = CONFIG_NAME,
            config_dir: str | Path | None = None) -> DictConfig:
    """Compose `config_name` (default `speco_trainer`) from `configs/` with Hydra overrides."""
    from verl_speco.train.compose import compose_raw, default_config_dir

    root = Path(config_dir) if config_dir is not None else default_config_dir()
    if not (root / f"{config_name}.yaml").is_file():
        raise FileNotFoundError(f"config {config_name!r} not found in {str(root)!r} (set --config-dir or "
                                "VERL_SPECO_CONFIG_DIR)")
    return compose_raw(overrides, config_name=config_name, config_dir=root)


def prepare(config: DictConfig) -> Any:
    """Validate the drafter section (moved aside for verl, see config_bridge) and verl's config."""
    from verl_speco.verl_integration.config_bridge import prepare_config

    return prepare_config(config)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="verl-speco", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("overrides", nargs="*", help="Hydra overrides (key=value, +key=value)")
    parser.add_argument("--config-name", default=CONFIG_NAME, help=f"config to compose (default {CONFIG_NAME})")
    parser.add_argument("--config-dir", default=None, help="config directory (default: the repository's configs/)")
    parser.add_argument("--cfg", choices=("job",), default=None, help="print the composed config and exit")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    from verl_speco.online.config import DrafterConfigError

    try:
        config = compose(args.overrides, args.config_name, args.config_dir)
        if args.cfg == "job":
            print(OmegaConf.to_yaml(config))
            return 0
        prepare(config)
    except (DrafterConfigError, FileNotFoundError) as err:
        print(f"verl-speco: config error: {err}", file=sys.stderr)
        return 2
    except Exception as err:  # noqa: BLE001 - Hydra composition errors are reported the same way
        if type(err).__module__.startswith(("hydra", "omegaconf")):
            print(f"verl-speco: config error: {err}", file=sys.stderr)
            return 2
        raise
    from verl_speco.verl_integration.task_runner import run

    run(config)
    return 0


if __name__ == "__main__":
    sys.exit(main())
