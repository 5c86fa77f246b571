"""The initial drafter of a CPU GRPO run (`--drafter trained`): a small EAGLE-3 trained offline on the
target's own greedy answers to the run's rule-reward problems, before the policy moves.

The embedded target: `train_small_drafter`, the quickstart's collect + train on the corpus's prompts.
Any other target: `train_task_drafter`, the train split of the run's own task answered by the target
through vLLM, then `verl-speco-draft-train` with the EAGLE-3 quickstart preset (a drafter trained on
another domain would mix the domain change into co-training's gain). Both run their CLIs in child
processes (`<out>/drafter.log`) and are reused when `<out>/drafter.json` names their export."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
TASK_MAX_NEW_TOKENS = 64    # the GRPO preset's max_response_length
REAL_DRAFT_VOCAB = 8192     # a real target's reduced EAGLE-3 draft vocabulary (SmolLM2: 8192 of 49152)


def _reused(done: Path) -> Path | None:
    if done.is_file():
        export = Path(json.loads(done.read_text())["export"])
        if (export / "config.json").is_file():
            return export
    return None


def _run_logged(stages: dict[str, list[str]], log: Path) -> None:
    """Run each stage's command in turn, all output to `log`; the first failure stops with its name."""
    with open(log, "w") as fh:
        for stage, cmd in stages.items():
            fh.write("$ " + " ".join(cmd) + "\n")
            fh.flush()
            rc = subprocess.run(cmd, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT).returncode
            if rc != 0:
                raise RuntimeError(f"training the initial drafter failed: {stage} exited {rc}; log {log}")


def train_small_drafter(out: Path, train_prompts: int = 128, steps: int = 120, seed: int = 0) -> Path:
    """The embedded target's initial drafter (`verl-speco-quickstart --skip-vllm` with fewer prompts and
    steps) under `out`; reused when `out` already holds its export."""
    done = out / "drafter.json"
    if (export := _reused(done)) is not None:
        return export
    cmd = [sys.executable, "-m", "verl_speco.quickstart", "--out", str(out), "--train-prompts", str(train_prompts),
           "--eval-prompts", "8", "--serve-prompts", "4", "--steps", str(steps), "--seed", str(seed),
           "--skip-vllm", "--json"]
    out.mkdir(parents=True, exist_ok=True)
    _run_logged({"quickstart": cmd}, out / "drafter.log")
    report = json.loads((out / "report.json").read_text())
    done.write_text(json.dumps({"export": report["export"], "reference": report["reference"],
                                "train_prompts": train_prompts, "steps": steps}, indent=1))
    return Path(report["export"])


def task_drafter_commands(out: Path, target: str, target_dir: Path, prompts: Path, steps: int, seed: int,
                          engine: str, vocab_size: int) -> dict[str, list[str]]:
    """The collect and train commands of `train_task_drafter` (EAGLE-3, the quickstart preset, a
    reduced draft vocabulary when the target's is larger than REAL_DRAFT_VOCAB)."""
    store = out / "store"
    collect = [sys.executable, "-m", "verl_speco.capture.collect", "--target", target, "--data", str(prompts),
               "--store", str(store), "--generate", "--engine", engine, "--layout-of", "eagle3",
               "--max-new-tokens", str(TASK_MAX_NEW_TOKENS), "--seed", str(seed)]
    train = [sys.executable, "-m", "verl_speco.train.launcher", "preset=quickstart_eagle3", f"target.path={target_dir}",
             f"data.store={store}", f"run.out_dir={out / 'train'}", "run.overwrite=true", f"run.seed={seed}",
             f"run.total_steps={steps}", f"run.save_every={steps}", "run.eval_every=0"]
    if vocab_size > REAL_DRAFT_VOCAB:
        train.append(f"drafter.settings.draft_vocab_size={REAL_DRAFT_VOCAB}")
    return {"collect": collect, "train": train}


def train_task_drafter(out: Path, target: str, task: str, train_prompts: int = 64, steps: int = 120,
                       seed: int = 0, engine: str = "vllm") -> Path:
    """An EAGLE-3 trained on `target`'s greedy answers to the first `train_prompts` problems of `task`'s
    train split (the GRPO run's own training problems, same seed), under `out`; reused when done."""
    from verl_speco.target.datasets import write_jsonl
    from verl_speco.target.named import resolve_target, target_config
    from verl_speco.target.rl_data import task_rows

    done = out / "drafter.json"
    if (export := _reused(done)) is not None:
        return export
    out.mkdir(parents=True, exist_ok=True)
    target_dir = resolve_target(target)
    rows: list[dict[str, Any]] = [{"messages": row["prompt"]} for row in task_rows(task, train_prompts, "train", seed)]
    prompts = write_jsonl(out / "prompts.jsonl", rows)
    vocab = int(target_config(target_dir)["vocab_size"])
    _run_logged(task_drafter_commands(out, target, target_dir, prompts, steps, seed, engine, vocab),
                out / "drafter.log")
    export = out / "train" / "ckpt" / f"step_{steps}" / "export"
    if not (export / "config.json").is_file():
        raise RuntimeError(f"training the initial drafter wrote no export at {export}; log {out / 'drafter.log'}")
    done.write_text(json.dumps({"export": str(export), "target": target, "task": task,
                                "train_prompts": train_prompts, "steps": steps}, indent=1))
    return export


def initial_drafter(out: Path, target: str, task: str, train_prompts: int = 64, seed: int = 0) -> Path:
    """`--drafter trained`: the embedded target's quickstart drafter on its corpus task, else a drafter
    trained on the first `train_prompts` problems of the run's own task."""
    if target == "embedded" and task == "corpus":
        return train_small_drafter(out, seed=seed)
    return train_task_drafter(out, target, task, train_prompts, seed=seed)
