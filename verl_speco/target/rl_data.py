"""A tiny rule-reward RL dataset in verl's parquet layout, and its reward.

`write_rl_dataset(dir, n_train, n_val, task=)` writes `train.parquet` and `val.parquet` (disjoint
splits), one problem per row with the columns verl's `RLHFDataset` and reward loop read
(`data_source`, `prompt` as chat messages, `ability`, `reward_model` {"style": "rule",
"ground_truth"}, `extra_info`). Tasks: `corpus`, the embedded corpus's problems in its own format;
`plain`, small additions and subtractions in plain English (for a real target, which never saw the
corpus's format); `plain_steps`, the same asked for worked answers (long text for GRPO to reshape).

`compute_score` (verl's `reward.custom_reward_function`): corpus rows get 1.0 for the answer stated
the corpus's way, else half the fraction of the reference's lines reproduced in order (a graded
signal for short rollouts); plain rows get 1.0 when the last integer is the answer, 0.25 when it
appears elsewhere, else 0."""

from __future__ import annotations

import os
import random
import re
from pathlib import Path
from typing import Any

DATA_SOURCE = "verl_speco/embedded"
PLAIN_SOURCE = "verl_speco/plain_arithmetic"
PLAIN_STEPS_SOURCE = "verl_speco/plain_arithmetic_steps"
# plain-English arithmetic tasks: (data source, the instruction after the question)
PLAIN_TASKS = {"plain": (PLAIN_SOURCE, "Reply with the number."),
               "plain_steps": (PLAIN_STEPS_SOURCE, "Think step by step, then give the answer.")}
_PLAIN_SOURCES = frozenset(source for source, _ in PLAIN_TASKS.values())  # scored by the last integer
TASKS = ("corpus", *PLAIN_TASKS)
_ANSWER_LEADS = ("The answer is ", "Sorted: ", "Result: ")
_INTEGER = re.compile(r"-?\d+")


def rl_rows(n: int, split: str = "train", seed: int = 0) -> list[dict[str, Any]]:
    """The rows of `n` problems of `split` (deterministic in `seed`)."""
    from verl_speco.target.corpus import generate_examples

    rows = []
    for i, ex in enumerate(generate_examples(n, seed=seed, split=split)):
        rows.append({"data_source": DATA_SOURCE, "prompt": [{"role": "user", "content": ex.prompt}],
                     "ability": ex.task, "reward_model": {"style": "rule", "ground_truth": ex.answer},
                     "extra_info": {"index": i, "split": split, "reference": ex.response}})
    return rows


PLAIN_POOL = 81 + 45  # distinct problems: a + b and a - b (a >= b) for digits a, b in 1..9


def plain_rows(n: int, split: str = "train", seed: int = 0, task: str = "plain") -> list[dict[str, Any]]:
    """`n` plain-English arithmetic problems of `split`: sums and differences of the digits 1..9
    (differences never negative; SmolLM2-135M answers about half of them), asked with `task`'s
    instruction (`PLAIN_TASKS`). All `PLAIN_POOL` problems are shuffled with `seed`; train takes them
    from the front, test from the back, so the splits share no problem while train + test <= PLAIN_POOL.
    The tasks share the pool and its order: `plain_steps` asks the very problems `plain` does."""
    source, instruction = PLAIN_TASKS[task]
    if not 1 <= n <= PLAIN_POOL:
        raise ValueError(f"plain arithmetic rows: got n={n}, expected 1..{PLAIN_POOL} (distinct problems)")
    pool = [(a, b, "add") for a in range(1, 10) for b in range(1, 10)]
    pool += [(a, b, "sub") for a in range(1, 10) for b in range(1, a + 1)]
    random.Random(seed).shuffle(pool)
    picked = pool[:n] if split == "train" else pool[::-1][:n]
    rows: list[dict[str, Any]] = []
    for a, b, op in picked:
        word, answer = ("plus", a + b) if op == "add" else ("minus", a - b)
        rows.append({"data_source": source,
                     "prompt": [{"role": "user", "content": f"What is {a} {word} {b}? {instruction}"}],
                     "ability": op, "reward_model": {"style": "rule", "ground_truth": str(answer)},
                     "extra_info": {"index": len(rows), "split": split, "a": a, "b": b}})
    return rows


def write_parquet(path: str | Path, rows: list[dict[str, Any]]) -> Path:
    """`rows` as a parquet file, written to a temporary name and renamed."""
    import pandas as pd

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    pd.DataFrame(rows).to_parquet(tmp, index=False)
    os.replace(tmp, path)
    return path


def write_rl_dataset(out_dir: str | Path, n_train: int = 64, n_val: int = 8, seed: int = 0,
                     task: str = "corpus") -> dict[str, Path]:
    """`{"train": <dir>/train.parquet, "val": <dir>/val.parquet}`, written; `task` is "corpus"
    (the embedded corpus's problems), "plain" (plain-English arithmetic) or "plain_steps" (the same,
    answered step by step)."""
    if n_train < 1 or n_val < 1:
        raise ValueError(f"n_train={n_train}, n_val={n_val}: expected both >= 1")
    if task not in TASKS:
        raise ValueError(f"task: got {task!r}, expected one of {TASKS}")
    if task in PLAIN_TASKS and n_train + n_val > PLAIN_POOL:
        raise ValueError(f"n_train + n_val: got {n_train} + {n_val}, expected <= {PLAIN_POOL} for task {task!r} "
                         "(disjoint splits of its distinct problems)")
    out = Path(out_dir)
    return {"train": write_parquet(out / "train.parquet", task_rows(task, n_train, "train", seed)),
            "val": write_parquet(out / "val.parquet", task_rows(task, n_val, "test", seed))}


def task_rows(task: str, n: int, split: str = "train", seed: int = 0) -> list[dict[str, Any]]:
    """The rows of `n` problems of `task`'s `split`: what write_rl_dataset writes, in the same order."""
    if task not in TASKS:
        raise ValueError(f"task: got {task!r}, expected one of {TASKS}")
    return rl_rows(n, split, seed) if task == "corpus" else plain_rows(n, split, seed, task)


def _states_answer(text: str, answer: str) -> bool:
    return any(f"{lead}{answer}." in text for lead in _ANSWER_LEADS)


def _line_prefix_share(text: str, reference: str) -> float:
    ref_lines = [line.strip() for line in reference.strip().splitlines() if line.strip()]
    got_lines = [line.strip() for line in text.strip().splitlines()]
    same = 0
    for ref, got in zip(ref_lines, got_lines):
        if ref != got:
            break
        same += 1
    return same / len(ref_lines) if ref_lines else 0.0


def compute_score(data_source: str, solution_str: str, ground_truth: str, extra_info: dict | None = None,
                  **kwargs: Any) -> float:
    """The rule reward of one response (see the module docstring)."""
    answer = str(ground_truth).strip()
    if data_source in _PLAIN_SOURCES:
        numbers = _INTEGER.findall(solution_str)
        if numbers and numbers[-1] == answer:
            return 1.0
        return 0.25 if answer in numbers else 0.0
    if _states_answer(solution_str, answer):
        return 1.0
    reference = str((extra_info or {}).get("reference", ""))
    return 0.5 * _line_prefix_share(solution_str, reference)
