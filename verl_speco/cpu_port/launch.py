"""One command for verl-speco GRPO on the CPU platform (scripts/run_cpu_grpo.sh).

    python -m verl_speco.cpu_port.launch [--out DIR] [--drafter DIR|fresh|trained] [hydra overrides]

Builds or reuses the target (`--target embedded` or `smollm2-135m`), writes the rule-reward dataset
under `<out>/data`, picks the initial drafter (`--drafter DIR`; `trained`: trained first on the
target's own answers, `initial_drafter`; default: the quickstart's newest export, else a fresh one;
recorded in `<out>/launch.json`), then runs `python -m verl_speco.main +speco_cpu=grpo_embedded ...`
in a child process with the CPU platform's environment, metrics in `<out>/metrics.jsonl` and drafts
published under `<out>/publish`. Exit status: the run's. The terminal gets a bar per stage and a
summary; the logs go to `<out>/run_cpu_grpo.log` unless --verbose."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from verl_speco.console import Console
from verl_speco.target.rl_data import TASKS

ROOT = Path(__file__).resolve().parents[2]
PRESET = "+speco_cpu=grpo_embedded"
PRESET_FILE = ROOT / "configs" / "speco_cpu" / "grpo_embedded.yaml"
LOG = "run_cpu_grpo.log"
SUMMARY_KEYS = (  # the end-of-run summary: verl / trainer metric -> label
    ("critic/score/mean", "score mean"), ("drafter/accept/mean_acceptance_length", "rollout acceptance length"),
    ("drafter/heldout/mean_acceptance_length", "held-out acceptance length"), ("drafter/loss", "drafter loss"),
    ("drafter/version", "drafter version"), ("timing_s/step", "step s"))
QUICKSTART_TRAIN = ROOT / "runs" / "quickstart" / "train"


def quickstart_drafter(train_dir: Path = QUICKSTART_TRAIN) -> Path | None:
    """The newest `export` directory the quickstart's training wrote (None when there is none)."""
    exports = [p for p in train_dir.glob("**/export") if (p / "config.json").is_file()]
    return max(exports, key=lambda p: p.stat().st_mtime) if exports else None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="run_cpu_grpo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="embedded",
                   help="named target (embedded, smollm2-135m) or an HF model directory (default: %(default)s)")
    p.add_argument("--out", default="runs/cpu_grpo", help="working directory (default: %(default)s)")
    p.add_argument("--drafter", default=None,
                   help="initial drafter export; 'fresh' for a freshly exported one; 'trained' to train a small "
                        "one first on the target's answers to the task, under <out>/drafter (reused) (default: the "
                        "quickstart's trained drafter if present, else fresh)")
    p.add_argument("--train-prompts", type=int, default=64, help="rows of train.parquet (default: %(default)s)")
    p.add_argument("--val-prompts", type=int, default=8,
                   help="rows of val.parquet, held-out problems (verl's validation; default: %(default)s)")
    p.add_argument("--task", choices=TASKS, default=None,
                   help="rule-reward problems: the embedded corpus's, plain-English arithmetic answered with the "
                        "number (plain) or step by step (plain_steps) (default: corpus for the embedded target, "
                        "plain for any other, which never saw the corpus's format)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--verbose", action="store_true",
                   help=f"verl, Ray and vLLM logs on the terminal (default: in <out>/{LOG})")
    p.add_argument("overrides", nargs="*", help="Hydra overrides passed to verl-speco")
    return p


def rl_task(target: str, task: str | None) -> str:
    """The rule-reward problems of a run: `task` when given, else the embedded corpus's for the
    embedded target and plain-English arithmetic for any other (it never saw the corpus's format)."""
    return task or ("corpus" if target == "embedded" else "plain")


def weight_bucket_megabytes(config: Mapping[str, Any], floor: int = 64) -> int:
    """verl's weight-sync bucket (`checkpoint_engine.update_weights_bucket_megabytes`) big enough for
    the target's largest float32 tensor (its embedding or an MLP matrix) with a quarter to spare;
    verl refuses a tensor larger than the bucket. SmolLM2-135M: embedding 49152 x 576 = 108 MiB -> 135."""
    hidden = int(config["hidden_size"])
    largest = hidden * max(int(config["vocab_size"]), int(config.get("intermediate_size", 0)))  # elements
    return max(floor, -(-largest * 4 * 5 // 4 // 2**20))


def launch_command(target: Path, data: dict[str, Path], out: Path, drafter: Path | None,
                   overrides: Sequence[str]) -> list[str]:
    from verl_speco.target import rl_data
    from verl_speco.target.named import target_config

    bucket = weight_bucket_megabytes(target_config(target))

    args = [sys.executable, "-m", "verl_speco.main", PRESET,
            f"actor_rollout_ref.model.path={target}",
            f"data.train_files={data['train']}", f"data.val_files={data['val']}",
            f"reward.custom_reward_function.path={Path(rl_data.__file__).resolve()}",
            "reward.custom_reward_function.name=compute_score",
            f"actor_rollout_ref.rollout.drafter.publish_dir={out / 'publish'}",
            f"actor_rollout_ref.rollout.drafter.feature_store.path={out / 'store'}",
            f"actor_rollout_ref.rollout.checkpoint_engine.update_weights_bucket_megabytes={bucket}"]
    if drafter is not None:
        args.append(f"actor_rollout_ref.rollout.drafter.model_path={drafter}")
    return args + list(overrides)


def planned_steps(overrides: Sequence[str]) -> int | None:
    """trainer.total_training_steps of the run: the last override that sets it, else the preset's
    (None when it is not a number: the progress bar then counts without a total)."""
    from omegaconf import OmegaConf

    value: Any = OmegaConf.select(OmegaConf.load(PRESET_FILE), "trainer.total_training_steps")
    for item in overrides:
        key, _, given = item.lstrip("+").partition("=")
        if key == "trainer.total_training_steps":
            value = given
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def logged_steps(metrics: Path) -> dict[int, dict[str, Any]]:
    """verl's file logger lines merged per step (validation before training is step 0)."""
    steps: dict[int, dict[str, Any]] = {}
    if metrics.is_file():
        for line in metrics.read_text().splitlines():
            try:
                record = json.loads(line)
                steps.setdefault(int(record["step"]), {}).update(record["data"])
            except (ValueError, KeyError, TypeError):
                continue  # a line being written
    return steps


def summary_lines(steps: dict[int, dict[str, Any]]) -> list[str]:
    """The last step's figures, one line (and the held-out figures before training, when logged)."""
    def figures(m: dict[str, Any]) -> str:
        return ", ".join(f"{label} {m[key]:.4g}" if isinstance(m[key], float) else f"{label} {m[key]}"
                         for key, label in SUMMARY_KEYS if key in m)

    lines = []
    if 0 in steps and figures(steps[0]):
        lines.append(f"  before training: {figures(steps[0])}")
    trained = [s for s in steps if s >= 1]
    if trained:
        lines.append(f"  step {max(trained)}: {figures(steps[max(trained)])}")
    return lines


class RunFailed(RuntimeError):
    def __init__(self, rc: int) -> None:
        super().__init__(f"verl-speco exited {rc}")
        self.rc = rc


def _run_verl(cmd: list[str], env: dict[str, str], metrics: Path, console: Console, total: int | None) -> None:
    """The verl run in a child process (its output where this process's fds 1 and 2 point), its
    progress read from the metrics it logs; raises RunFailed on a non-zero exit."""
    with console.stage("GRPO steps", total=total) as bar:
        proc = subprocess.Popen(cmd, env=env, cwd=ROOT)
        try:
            while True:
                try:
                    rc = proc.wait(timeout=2.0)
                    break
                except subprocess.TimeoutExpired:
                    bar.set(max((s for s in logged_steps(metrics) if s >= 1), default=0))
        except BaseException:
            proc.terminate()
            proc.wait()
            raise
        if rc != 0:
            raise RunFailed(rc)


class DrafterMismatch(ValueError):
    """A given drafter export was built for another target."""


def check_drafter_fits(drafter: Path, target: Path) -> None:
    """Refuse a drafter export this target cannot load (say, the embedded target's drafter given with
    `--target smollm2-135m`): the family that wrote it reads it back on the target's embedding and LM
    head, the check the online session makes on `drafter.model_path` later, made before anything runs."""
    from drafters.common.target import TargetHead
    from drafters.registry import export_family, get_family

    try:
        get_family(export_family(drafter)).load_export(drafter, TargetHead.from_pretrained(target))
    except (OSError, ValueError, KeyError, RuntimeError) as err:
        raise DrafterMismatch(f"--drafter {drafter}: {err}; expected an export trained on the target {target.name} "
                              "(or 'trained' or 'fresh')") from err


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    out = Path(args.out).resolve()  # created once the drafter choice is valid
    drafter: Path | None
    target: Path | None = None  # resolved here only to check a given drafter, else in _launch
    if args.target != "embedded" and args.drafter is None:
        drafter, source = None, f"fresh (the quickstart drafter belongs to the embedded target, not {args.target})"
    elif args.drafter in ("fresh", "trained"):
        drafter, source = None, args.drafter
    elif args.drafter:
        drafter, source = Path(args.drafter).resolve(), "given"
        if not (drafter / "config.json").is_file():
            print(f"run_cpu_grpo: --drafter {args.drafter!r}: no config.json there (expected a drafter export "
                  "directory, or 'fresh')", file=sys.stderr)
            return 2
        from verl_speco.target.named import resolve_target

        target = resolve_target(args.target, log=print)  # before anything is written
        try:
            check_drafter_fits(drafter, target)
        except DrafterMismatch as mismatch:
            print(f"run_cpu_grpo: {mismatch}", file=sys.stderr)
            return 2
    else:
        drafter = quickstart_drafter()
        source = "quickstart" if drafter is not None else "fresh (no quickstart export under runs/quickstart)"
    out.mkdir(parents=True, exist_ok=True)
    console = Console(out / LOG, verbose=args.verbose, name="run_cpu_grpo")
    started = time.perf_counter()
    metrics = out / "metrics.jsonl"
    try:
        with console:
            _launch(args, out, target, drafter, source, metrics, console)
    except RunFailed as failed:
        console.print(f"[run_cpu_grpo] exit {failed.rc} after {time.perf_counter() - started:.1f} s; "
                      f"metrics: {metrics}", err=True)
        return failed.rc
    except Exception:
        if console.quiet:
            return 1  # the console showed the error and the log's last lines
        raise
    steps = logged_steps(metrics)
    console.print(f"[run_cpu_grpo] exit 0 after {time.perf_counter() - started:.1f} s, "
                  f"{len([s for s in steps if s >= 1])} GRPO steps")
    for line in summary_lines(steps):
        console.print(line)
    console.print(f"  metrics: {metrics}" + (f"; logs: {console.log_path}" if console.quiet else ""))
    return 0


def _launch(args: argparse.Namespace, out: Path, target: Path | None, drafter: Path | None, source: str,
            metrics: Path, console: Console) -> None:
    from verl_speco.cpu_port.env import cpu_environment
    from verl_speco.target.named import resolve_target
    from verl_speco.target.rl_data import write_rl_dataset

    with console.stage("build target", total=1):
        target = target or resolve_target(args.target, log=print)
        task = rl_task(args.target, args.task)
        data = write_rl_dataset(out / "data", n_train=args.train_prompts, n_val=args.val_prompts, seed=args.seed,
                                task=task)
    if source == "trained":
        from verl_speco.cpu_port.initial_drafter import initial_drafter

        with console.stage("initial drafter", total=1):
            drafter = initial_drafter(out / "drafter", args.target, task, args.train_prompts, args.seed)
            source = f"trained on the target's answers to the {task} task"
    console.print(f"[run_cpu_grpo] target {target}; initial drafter: {drafter or 'freshly exported'} ({source})")
    cmd = launch_command(target, data, out, drafter, args.overrides)
    env = cpu_environment()
    env["VERL_FILE_LOGGER_PATH"] = str(metrics)
    metrics.unlink(missing_ok=True)  # the steps counted are this run's
    (out / "launch.json").write_text(json.dumps({"target": str(target), "drafter": str(drafter) if drafter else None,
                                                 "drafter_source": source, "task": task, "command": cmd}, indent=1))
    _run_verl(cmd, env, metrics, console, planned_steps(args.overrides))


if __name__ == "__main__":
    sys.exit(main())
