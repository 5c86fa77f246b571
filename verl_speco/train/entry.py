"""Per-process entry of the drafter trainer (what torchrun starts on every rank).

    python -m verl_speco.train.entry [--config-dir DIR] [--config-name NAME] [--print-config] \
        key=value ... [preset=quickstart_eagle3]

Composes `configs/<config-name>.yaml` with the Hydra overrides against the typed schema
(`verl_speco/train/config.py`), checks the inputs (`verl_speco.train.preflight`), then trains
(`verl_speco.train.loop.run`). A user error (config, store, target, resume path) is one line
`verl-speco-draft-train: error: ...` on stderr and exit status 2. Usually started by
`verl-speco-draft-train`, which adds torchrun for several processes or nodes."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from verl_speco.train.compose import DEFAULT_CONFIG_NAME, load_config


def config_parser(prog: str, description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=description,
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="Overrides use Hydra syntax: data.store=/path run.total_steps=100 "
                                            "preset=quickstart_eagle3 drafter.settings.ttt_steps=3. Every key "
                                            "is typed by verl_speco/train/config.py; unknown keys fail.")
    parser.add_argument("--config-dir", default=None,
                        help="directory of the YAML configs (default: $VERL_SPECO_CONFIG_DIR or the "
                             "repository's configs/)")
    parser.add_argument("--config-name", default=DEFAULT_CONFIG_NAME,
                        help=f"top-level config (default: {DEFAULT_CONFIG_NAME})")
    parser.add_argument("--print-config", action="store_true",
                        help="print the composed, validated config as YAML and exit")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides (key=value)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = config_parser("python -m verl_speco.train.entry",
                           "One trainer process (started by verl-speco-draft-train / torchrun).")
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    from verl_speco.train.preflight import USER_ERRORS, check_inputs, report

    try:
        cfg = load_config(args.overrides, args.config_name, args.config_dir)
        if args.print_config:
            from omegaconf import OmegaConf

            print(OmegaConf.to_yaml(OmegaConf.structured(cfg)), end="")
            return 0
        check_inputs(cfg, world_size=int(os.environ.get("WORLD_SIZE", "1")))
        from verl_speco.train.loop import run

        summary = run(cfg)
    except USER_ERRORS as err:  # the user's input: one line, exit 2 (anything else is a bug: traceback)
        return report(err, os.environ.get("RANK") if int(os.environ.get("WORLD_SIZE", "1")) > 1 else None)
    if os.environ.get("RANK", "0") == "0":
        print(f"verl-speco-draft-train: done {summary}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
