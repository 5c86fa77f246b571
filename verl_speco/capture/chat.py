"""Chat datasets and chat tokenization with the response (loss) mask.

The loss mask is 1 exactly on the tokens the target produces for an assistant turn: the turn's
content and its end-of-turn token, found from the chat template's own boundaries (render the
conversation up to the turn with the generation prompt; the response starts where that prefix
ends and stops after the first end-of-turn token). Template text after the end-of-turn token
(e.g. the newline) and the role header are not response tokens."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

Message = dict[str, str]
_ROLES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
          "system": "system", "tool": "tool"}


@dataclass
class TokenizedChat:
    input_ids: torch.Tensor   # [T] int64
    loss_mask: torch.Tensor   # [T] uint8, 1 on response tokens

    @property
    def num_response_tokens(self) -> int:
        return int(self.loss_mask.sum())


def _objects(value: Any, where: str, key: str, fields: str) -> list[dict[str, Any]]:
    """`value` must be a list of JSON objects (one per message)."""
    if not isinstance(value, list):
        raise ValueError(f"{where}: {key!r} is {_short(value)} ({type(value).__name__}): expected a list of "
                         f"objects with {fields}")
    for i, m in enumerate(value):
        if not isinstance(m, dict):
            raise ValueError(f"{where}: {key}[{i}] is {_short(m)} ({type(m).__name__}): expected a list of "
                             f"objects with {fields}")
    return value


def _short(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def normalize_record(record: Any, where: str) -> list[Message]:
    """One JSONL row -> a list of chat messages. Accepted rows: ``{"messages": [...]}`` (OpenAI
    style), ``{"conversations": [{"from", "value"}]}`` (ShareGPT), or ``{"prompt": str | messages,
    "response": str (optional)}``. ``where`` (``file:line``) starts every error message."""
    if not isinstance(record, dict):
        raise ValueError(f"{where}: expected a JSON object, got {type(record).__name__}")
    if "messages" in record:
        raw = _objects(record["messages"], where, "messages", "'role' and 'content'")
    elif "conversations" in record:
        raw = [{"role": m.get("from"), "content": m.get("value")}
               for m in _objects(record["conversations"], where, "conversations", "'from' and 'value'")]
    elif "prompt" in record:
        prompt = record["prompt"]
        raw = ([{"role": "user", "content": prompt}] if isinstance(prompt, str)
               else list(_objects(prompt, where, "prompt", "'role' and 'content' (or a string)")))
        if record.get("response") is not None:
            raw.append({"role": "assistant", "content": record["response"]})
    else:
        raise ValueError(f"{where}: expected a 'messages', 'conversations' or 'prompt' field, "
                         f"got keys {sorted(record)}")
    messages = []
    for j, m in enumerate(raw):
        role = _ROLES.get(str(m.get("role")))
        if role is None or not isinstance(m.get("content"), str):
            raise ValueError(f"{where}: message {j} = {m!r}: expected a role in {sorted(_ROLES)} "
                             f"and a string content")
        messages.append({"role": role, "content": m["content"]})
    if not messages:
        raise ValueError(f"{where}: empty conversation")
    return messages


def load_chats(path: str | Path, max_samples: int | None = None) -> list[list[Message]]:
    """Read a JSONL chat dataset (blank lines skipped); the first ``max_samples`` rows. Errors name
    ``file:line`` (bad UTF-8, bad JSON, a row of the wrong shape); a missing file names the path."""
    chats: list[list[Message]] = []
    try:
        f = open(path, "rb")
    except OSError as e:
        raise ValueError(f"{path}: cannot read the chat dataset ({e.strerror}); expected a JSONL file") from e
    with f:
        for lineno, raw_line in enumerate(f, 1):
            if max_samples is not None and len(chats) >= max_samples:
                break
            where = f"{path}:{lineno}"
            try:
                line = raw_line.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{where}: not valid UTF-8 (byte {raw_line[e.start]:#04x} at column "
                                 f"{e.start + 1}); expected UTF-8 JSON lines") from e
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{where}: invalid JSON ({e})") from e
            chats.append(normalize_record(row, where))
    return chats


def prompt_messages(messages: Sequence[Message]) -> list[Message]:
    """The context a generated response continues: every message before the final assistant turn
    (all of them when the conversation does not end with an assistant)."""
    if messages[-1]["role"] == "assistant":
        messages = messages[:-1]
    if not messages:
        raise ValueError("prompt_messages: the conversation has no message before the assistant turn")
    return list(messages)


def _ids(tokenizer: Any, messages: Sequence[Message], add_generation_prompt: bool) -> list[int]:
    ids = tokenizer.apply_chat_template(list(messages), tokenize=True, return_dict=False,
                                        add_generation_prompt=add_generation_prompt)
    if isinstance(ids, dict) or hasattr(ids, "keys"):   # BatchEncoding in some versions
        ids = ids["input_ids"]
    return [int(i) for i in ids]


def encode_prompt(tokenizer: Any, messages: Sequence[Message]) -> list[int]:
    """Token ids of ``messages`` rendered with the generation prompt (what generation starts from)."""
    return _ids(tokenizer, messages, add_generation_prompt=True)


def tokenize_chat(tokenizer: Any, messages: Sequence[Message], end_ids: Iterable[int]) -> TokenizedChat:
    """Render + tokenize a whole conversation and mark every assistant turn's response tokens.

    ``end_ids``: end-of-turn token ids (the eos ids of the target); the response span of a turn
    ends after the first of them. A template that does not reproduce a turn's prefix
    token-for-token inside the full conversation is rejected (the boundary would be a guess)."""
    ends = {int(i) for i in end_ids}
    full = _ids(tokenizer, messages, add_generation_prompt=False)
    mask = [0] * len(full)
    for turn, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        if turn == 0:
            raise ValueError("tokenize_chat: an assistant turn needs a preceding message")
        prefix = _ids(tokenizer, messages[:turn], add_generation_prompt=True)
        if full[: len(prefix)] != prefix:
            raise ValueError(f"tokenize_chat: the chat template's rendering of messages[:{turn}] with "
                             f"the generation prompt is not a token prefix of the full conversation; "
                             f"cannot locate assistant turn {turn}")
        start = len(prefix)
        # the turn's own rendering bounds the search (templates may re-render the last turn, e.g. a
        # thinking block: then it is not a prefix and the conversation's end bounds it instead)
        upto = _ids(tokenizer, messages[: turn + 1], add_generation_prompt=False)
        limit = len(upto) if full[: len(upto)] == upto else None
        stop = next((k + 1 for k in range(start, limit or len(full)) if full[k] in ends), limit)
        if stop is None:
            raise ValueError(f"tokenize_chat: no end-of-turn token {sorted(ends)} after assistant turn "
                             f"{turn}, and its rendering is not a prefix of the conversation")
        mask[start:stop] = [1] * (stop - start)
    return TokenizedChat(torch.tensor(full, dtype=torch.long), torch.tensor(mask, dtype=torch.uint8))


def join_generated(prompt_ids: Sequence[int], response_ids: Sequence[int]) -> TokenizedChat:
    """A prompt + a generated response: the mask is 1 exactly on the generated tokens."""
    ids = list(prompt_ids) + list(response_ids)
    mask = [0] * len(prompt_ids) + [1] * len(response_ids)
    return TokenizedChat(torch.tensor(ids, dtype=torch.long), torch.tensor(mask, dtype=torch.uint8))
