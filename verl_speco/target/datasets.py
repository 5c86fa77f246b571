"""JSONL datasets drawn from the target corpus (prompts for rollouts, collection and evaluation).

One row per line: `{"id", "task", "answer", "messages": [user turn]}`. With `include_reference=True` the assistant turn of the chosen variant is appended to `messages`
(the full conversation offline feature collection runs the target over). Files are written to a
temporary name and renamed, so a reader never sees a half-written file."""

from __future__ import annotations

import json
import os
from pathlib import Path

from verl_speco.target.corpus import generate_examples


def prompt_rows(
    n: int, variant: str = "base", split: str = "test", seed: int = 0, include_reference: bool = False
) -> list[dict[str, object]]:
    """The rows `write_prompt_dataset` writes, in order."""
    rows: list[dict[str, object]] = []
    for i, ex in enumerate(generate_examples(n, seed=seed, variant=variant, split=split)):
        messages = ex.messages if include_reference else ex.messages[:1]
        rows.append({"id": f"{split}-{i}", "task": ex.task, "answer": ex.answer, "messages": messages})
    return rows


def write_jsonl(path: str | Path, rows: list[dict[str, object]]) -> Path:
    """Write `rows` as JSON lines, atomically (temporary file in the same folder, then rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")
    os.replace(tmp, path)
    return path


def read_jsonl(path: str | Path) -> list[dict[str, object]]:
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def write_prompt_dataset(
    path: str | Path,
    n: int,
    variant: str = "base",
    split: str = "test",
    seed: int = 0,
    include_reference: bool = False,
) -> Path:
    """Write `n` chat rows of `split` ("train" or "held-out" "test") to `path`; returns `path`.

    Prompts do not depend on `variant`; it only selects the style of the reference answers."""
    return write_jsonl(path, prompt_rows(n, variant, split, seed, include_reference))
