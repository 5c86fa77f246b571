"""One command for verl-speco GRPO on the CPU platform with the embedded target (scripts/run_cpu_grpo.sh).

    python -m verl_speco.verl_integration.cpu_launch [--out DIR] [--drafter DIR|fresh] [hydra overrides]

1. builds (or reuses) the embedded target (`verl_speco.target.ensure_target`);
2. writes the rule-reward dataset (`verl_speco.target.rl_data`) under `<out>/data`;
3. picks the initial drafter: `--drafter DIR`; by default the quickstart's trained export
   (`runs/quickstart/train/**/export`, the newest) when it exists, else a freshly exported initial
   drafter (`drafter.model_path=null`); the choice is printed and written to `<out>/launch.json`;
4. runs `python -m verl_speco.main +speco_cpu=grpo_embedded ...` (configs/speco_cpu/grpo_embedded.yaml)
   in a child process with the CPU platform's environment (`cpu_env.cpu_environment`), verl's file
   logger at `<out>/metrics.jsonl` (every step's metrics, `drafter/*` included) and drafts published
   under `<out>/publish`. Extra arguments are Hydra overrides (e.g. `trainer.total_training_steps=5`,
   `actor_rollout_ref.rollout.drafter.mode=collect_only`). Exit status: the run's.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PRESET = "+speco_cpu=grpo_embedded"
QUICKSTART_TRAIN = ROOT / "runs" / "quickstart" / "train"


def quickstart_drafter(train_dir: Path = QUICKSTART_TRAIN) -> Path | None:
    """The newest `export` directory the quickstart's training wrote (None when there is none)."""
    exports = [p for p in train_dir.glob("**/export") if (p / "config.json").is_file()]
    return max(exports, key=lambda p: p.stat().st_mtime) if exports else None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="run_cpu_grpo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/cpu_grpo", help="working directory (default: %(default)s)")
    p.add_argument("--drafter", default=None,
                   help="initial drafter export; 'fresh' for a freshly exported one (default: the quickstart's "
                        "trained drafter if present, else fresh)")
    p.add_argument("--train-prompts", type=int, default=64, help="rows of train.parquet (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("overrides", nargs="*", help="Hydra overrides passed to verl-speco")
    return p


def launch_command(target: Path, data: dict[str, Path], out: Path, drafter: Path | None,
                   overrides: Sequence[str]) -> list[str]:
    from verl_speco.target import rl_data

    args = [sys.executable, "-m", "verl_speco.main", PRESET,
            f"actor_rollout_ref.model.path={target}",
            f"data.train_files={data['train']}", f"data.val_files={data['val']}",
            f"reward.custom_reward_function.path={Path(rl_data.__file__).resolve()}",
            "reward.custom_reward_function.name=compute_score",
            f"actor_rollout_ref.rollout.drafter.publish_dir={out / 'publish'}",
            f"actor_rollout_ref.rollout.drafter.feature_store.path={out / 'store'}"]
    if drafter is not None:
        args.append(f"actor_rollout_ref.rollout.drafter.model_path={drafter}")
    return args + list(overrides)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    from verl_speco.target import ensure_target
    from verl_speco.target.rl_data import write_rl_dataset
    from verl_speco.verl_integration.cpu_env import cpu_environment

    if args.drafter == "fresh":
        drafter, source = None, "fresh"
    elif args.drafter:
        drafter, source = Path(args.drafter).resolve(), "given"
        if not (drafter / "config.json").is_file():
            print(f"run_cpu_grpo: --drafter {args.drafter!r}: no config.json there (expected a drafter export "
                  "directory, or 'fresh')", file=sys.stderr)
            return 2
    else:
        drafter = quickstart_drafter()
        source = "quickstart" if drafter is not None else "fresh (no quickstart export under runs/quickstart)"
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    target = Path(ensure_target(log=print))
    data = write_rl_dataset(out / "data", n_train=args.train_prompts, seed=args.seed)
    print(f"[run_cpu_grpo] target {target}; initial drafter: {drafter or 'freshly exported'} ({source})", flush=True)
    cmd = launch_command(target, data, out, drafter, args.overrides)
    env = cpu_environment()
    env["VERL_FILE_LOGGER_PATH"] = str(out / "metrics.jsonl")
    (out / "launch.json").write_text(json.dumps({"target": str(target), "drafter": str(drafter) if drafter else None,
                                                 "drafter_source": source, "command": cmd}, indent=1))
    started = time.perf_counter()
    rc = subprocess.run(cmd, env=env, cwd=ROOT).returncode
    print(f"[run_cpu_grpo] exit {rc} after {time.perf_counter() - started:.1f} s; metrics: {out / 'metrics.jsonl'}",
          flush=True)
    return rc


if __name__ == "__main__":
    sys.exit(main())
