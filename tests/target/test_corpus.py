import hashlib
import json
import os
import re
import subprocess
import sys

import pytest

from verl_speco.target.corpus import TASKS, generate_examples, make_example, split_of
from verl_speco.target.datasets import read_jsonl, write_prompt_dataset

_OPS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}


def _operands(prompt: str) -> tuple[int, str, int]:
    """Operands of an arithmetic prompt, parsed independently of the generator."""
    if m := re.fullmatch(r"(?:What is|Compute) (\d+) ([-+*]) (\d+)[.?]", prompt):
        return int(m[1]), m[2], int(m[3])
    if m := re.fullmatch(r"Add (\d+) and (\d+)\.", prompt):
        return int(m[1]), "+", int(m[2])
    if m := re.fullmatch(r"Subtract (\d+) from (\d+)\.", prompt):
        return int(m[2]), "-", int(m[1])
    m = re.fullmatch(r"Multiply (\d+) by (\d+)\.", prompt)
    assert m, prompt
    return int(m[1]), "*", int(m[2])


_DIGEST_CODE = """
import hashlib, json
from verl_speco.target.corpus import generate_examples
blob = json.dumps([e.to_json() for e in generate_examples(40, seed=3, variant="shifted")])
print(hashlib.sha256(blob.encode()).hexdigest())
"""


def test_deterministic_within_and_across_processes() -> None:
    assert generate_examples(40, seed=3) == generate_examples(40, seed=3)
    blob = json.dumps([e.to_json() for e in generate_examples(40, seed=3, variant="shifted")])
    outs = {
        subprocess.run([sys.executable, "-c", _DIGEST_CODE], capture_output=True, text=True, check=True,
                       env={**os.environ, "PYTHONHASHSEED": str(h)}).stdout.strip()
        for h in (1, 2)
    }
    assert outs == {hashlib.sha256(blob.encode()).hexdigest()}
    assert generate_examples(40, seed=4) != generate_examples(40, seed=3)


def test_all_tasks_present() -> None:
    assert {e.task for e in generate_examples(300)} == set(TASKS)


def test_base_arithmetic_traces_are_correct() -> None:
    step = re.compile(r"(\w+): (1?\d) ([-+*]) (\d) ([-+]) (\d) = (\d+), write (\d), (carry|borrow) (\d)\.")
    columns = ["ones", "tens", "hundreds", "thousands"]
    for ex in generate_examples(400, seed=7):
        if ex.task not in ("add", "sub", "mul"):
            continue
        a, op, b = _operands(ex.prompt)
        assert ex.answer == str(_OPS[op](a, b))
        lines = ex.response.splitlines()
        assert lines[-1] == f"The answer is {ex.answer}."
        written, carry_in = [], "0"
        top_digits, bottom_digits = str(a)[::-1], str(b)[::-1]
        for i, (column, line) in enumerate(zip(columns, lines[1:-1])):
            if m := re.fullmatch(r"(\w+): carry (\d), write (\d)\.", line):
                assert m[1] == column and m[2] == m[3] == carry_in != "0", line
                written.append(m[3])
                continue
            m = step.fullmatch(line)
            assert m, line
            col, x, o, y, o2, c, s, d, kind, k = m.groups()
            assert col == column and c == carry_in, line
            assert x[-1] == (top_digits[i:i + 1] or "0"), line
            assert y == (b_digit := (str(b) if op == "*" else bottom_digits[i:i + 1] or "0")), (line, b_digit)
            value = _OPS[o](int(x), int(y)) + (int(c) if o2 == "+" else -int(c))
            assert int(s) == value and int(d) == value % 10, line
            assert int(k) == (value // 10 if kind == "carry" else int(len(x) == 2)), line
            written.append(d)
            carry_in = k
        assert int("".join(reversed(written))) == int(ex.answer)


def test_count_and_sort_answers() -> None:
    for ex in generate_examples(400, seed=8):
        nums = [int(x) for x in re.findall(r"\d+", ex.prompt)]
        if ex.task == "sort":
            assert ex.answer == ", ".join(map(str, sorted(nums)))
            assert ex.response.endswith(f"Sorted: {ex.answer}.")
        elif ex.task == "count":
            start, stop, stepv = (nums[0], nums[1], nums[2]) if "steps of" in ex.prompt or "going up" in ex.prompt \
                else (nums[1], nums[2], nums[0])
            expected = list(range(start, stop + 1, stepv))
            assert ex.answer == str(stop) == str(expected[-1])
            assert ex.response == f"Counting by {stepv}: " + ", ".join(map(str, expected)) + "."


def test_shifted_variant_same_prompts_other_style() -> None:
    base, shifted = generate_examples(200, seed=5), generate_examples(200, seed=5, variant="shifted")
    assert [e.prompt for e in base] == [e.prompt for e in shifted]
    assert [e.answer for e in base] == [e.answer for e in shifted]
    assert all(b.response != s.response for b, s in zip(base, shifted))
    for s in shifted:
        if s.task in ("add", "sub"):
            assert "Column 1: " in s.response and "Check: " in s.response
        assert s.answer in s.response.splitlines()[-1]


def test_splits_are_disjoint_and_sized() -> None:
    train = {e.prompt for e in generate_examples(3000, seed=0)}
    test = generate_examples(150, seed=0, split="test")
    assert not train & {e.prompt for e in test}
    assert all(split_of(e.prompt) == "test" for e in test)
    raw = [make_example(0, i) for i in range(4000)]
    frac = sum(split_of(e.prompt) == "test" for e in raw) / len(raw)
    assert 0.03 < frac < 0.08


def test_bad_arguments_name_the_value() -> None:
    with pytest.raises(ValueError, match="variant='odd'"):
        generate_examples(1, variant="odd")
    with pytest.raises(ValueError, match="split='dev'"):
        generate_examples(1, split="dev")


def test_write_prompt_dataset(tmp_path) -> None:
    path = write_prompt_dataset(tmp_path / "d" / "p.jsonl", 12, variant="shifted", split="test", seed=2)
    rows = read_jsonl(path)
    refs = generate_examples(12, seed=2, variant="shifted", split="test")
    assert [r["id"] for r in rows] == [f"test-{i}" for i in range(12)]
    assert [r["messages"] for r in rows] == [[{"role": "user", "content": e.prompt}] for e in refs]
    assert [r["answer"] for r in rows] == [e.answer for e in refs]
    full = read_jsonl(write_prompt_dataset(tmp_path / "f.jsonl", 3, include_reference=True))
    assert full[0]["messages"][1]["role"] == "assistant"
    assert full[0]["messages"][1]["content"] == generate_examples(1, split="test")[0].response
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["p.jsonl"]
