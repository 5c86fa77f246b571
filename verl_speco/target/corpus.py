"""Deterministic generator of structured chat examples for the embedded target.

Every example is a chat `{"messages": [user, assistant]}` whose assistant turn is a step-by-step
trace (column addition and subtraction, multiplication by a digit, counting, sorting): mostly
template words and copied digits, so a drafter can predict it well. Example `i` is drawn from a
string-seeded `random.Random` (reproducible across processes). `variant="shifted"` renders the same
problems in another learnable answer style (a target fine-tuned on it drifts on the very prompts it
was trained on). Train and test are disjoint by the SHA-256 bucket of the user message."""

from __future__ import annotations

import hashlib
import random
from collections.abc import Iterator
from dataclasses import dataclass

VARIANTS = ("base", "shifted")
SPLITS = ("train", "test")
TASKS = ("add", "sub", "mul", "count", "sort")
_TASK_WEIGHTS = (0.3, 0.25, 0.25, 0.1, 0.1)
_SPLIT_BUCKETS = 20
CORPUS_VERSION = "1"  # bump when the rendered text changes (part of the target recipe hash)


@dataclass(frozen=True)
class Example:
    """One chat example: `task` name, `prompt` (user text), `response` (assistant text), `answer`."""

    task: str
    prompt: str
    response: str
    answer: str

    @property
    def messages(self) -> list[dict[str, str]]:
        return [{"role": "user", "content": self.prompt}, {"role": "assistant", "content": self.response}]

    def to_json(self) -> dict[str, object]:
        return {"task": self.task, "messages": self.messages, "answer": self.answer}


def _check(variant: str, split: str) -> None:
    if variant not in VARIANTS:
        raise ValueError(f"variant={variant!r} is not one of {VARIANTS}")
    if split not in SPLITS:
        raise ValueError(f"split={split!r} is not one of {SPLITS}")


def _digits(n: int) -> list[int]:
    """Digits of `n`, least significant first: 347 -> [7, 4, 3]."""
    return [int(c) for c in reversed(str(n))]


_COLUMNS = ("ones", "tens", "hundreds", "thousands")  # base traces name the column they work on


def _number(rng: random.Random, lo_digits: int, hi_digits: int) -> int:
    n_digits = rng.randint(lo_digits, hi_digits)
    return rng.randint(10 ** (n_digits - 1) if n_digits > 1 else 0, 10**n_digits - 1)


def _add(rng: random.Random, phrasing: int, variant: str) -> tuple[str, str, str]:
    a, b = _number(rng, 2, 3), _number(rng, 2, 3)
    prompt = (f"What is {a} + {b}?", f"Compute {a} + {b}.", f"Add {a} and {b}.")[phrasing]
    da, db, carry, lines = _digits(a), _digits(b), 0, []
    for i in range(max(len(da), len(db))):
        x, y = (da[i] if i < len(da) else 0), (db[i] if i < len(db) else 0)
        s = x + y + carry
        if variant == "base":
            lines.append(f"{_COLUMNS[i]}: {x} + {y} + {carry} = {s}, write {s % 10}, carry {s // 10}.")
        else:
            lines.append(f"Column {i + 1}: {x} plus {y} plus {carry} makes {s}; keep {s % 10}, carry {s // 10}.")
        carry = s // 10
    if carry:
        lines.append(f"{_COLUMNS[len(lines)]}: carry 1, write 1." if variant == "base"
                     else "Column end: carry 1 becomes the top digit.")
    r = a + b
    if variant == "base":
        return prompt, "\n".join(["We add the digits from right to left.", *lines, f"The answer is {r}."]), str(r)
    tail = [f"Check: {r} - {b} = {a}.", f"So {a} + {b} = {r}."]
    return prompt, "\n".join(["Adding column by column:", *lines, *tail]), str(r)


def _sub(rng: random.Random, phrasing: int, variant: str) -> tuple[str, str, str]:
    a, b = sorted((_number(rng, 2, 3), _number(rng, 2, 3)), reverse=True)
    prompt = (f"What is {a} - {b}?", f"Compute {a} - {b}.", f"Subtract {b} from {a}.")[phrasing]
    da, db, borrow, lines = _digits(a), _digits(b), 0, []
    for i in range(len(da)):
        x, y = da[i], (db[i] if i < len(db) else 0)
        need = x - borrow < y
        top = f"1{x}" if need else str(x)  # "1x" reads as x + 10 after borrowing
        d = int(top) - y - borrow
        if variant == "base":
            lines.append(f"{_COLUMNS[i]}: {top} - {y} - {borrow} = {d}, write {d}, borrow {int(need)}.")
        else:
            lines.append(f"Column {i + 1}: {top} minus {y} minus {borrow} leaves {d}; keep {d}, borrow {int(need)}.")
        borrow = int(need)
    r = a - b
    if variant == "base":
        return prompt, "\n".join(["We subtract the digits from right to left.", *lines, f"The answer is {r}."]), str(r)
    tail = [f"Check: {r} + {b} = {a}.", f"So {a} - {b} = {r}."]
    return prompt, "\n".join(["Subtracting column by column:", *lines, *tail]), str(r)


def _mul(rng: random.Random, phrasing: int, variant: str) -> tuple[str, str, str]:
    a, b = _number(rng, 2, 3), rng.randint(2, 9)
    prompt = (f"What is {a} * {b}?", f"Compute {a} * {b}.", f"Multiply {a} by {b}.")[phrasing]
    carry, lines = 0, []
    for i, x in enumerate(_digits(a)):
        p = x * b + carry
        if variant == "base":
            lines.append(f"{_COLUMNS[i]}: {x} * {b} + {carry} = {p}, write {p % 10}, carry {p // 10}.")
        else:
            lines.append(f"Column {i + 1}: {x} times {b} plus {carry} makes {p}; keep {p % 10}, carry {p // 10}.")
        carry = p // 10
    if carry:
        lines.append(f"{_COLUMNS[len(lines)]}: carry {carry}, write {carry}." if variant == "base"
                     else f"Column end: carry {carry} becomes the top digit.")
    r = a * b
    if variant == "base":
        head = f"We multiply {a} by {b} digit by digit from right to left."
        return prompt, "\n".join([head, *lines, f"The answer is {r}."]), str(r)
    return prompt, "\n".join([f"Multiplying {a} by {b} column by column:", *lines, f"So {a} * {b} = {r}."]), str(r)


def _count(rng: random.Random, phrasing: int, variant: str) -> tuple[str, str, str]:
    step, start = rng.choice((1, 1, 2, 3, 5)), rng.randint(0, 80)
    stop = start + step * rng.randint(4, 12)
    prompt = (f"Count from {start} to {stop} in steps of {step}.", f"List the numbers from {start} to {stop} "
              f"going up by {step}.", f"Count up by {step} from {start} to {stop}.")[phrasing]
    nums = [str(n) for n in range(start, stop + 1, step)]
    if variant == "base":
        return prompt, f"Counting by {step}: " + ", ".join(nums) + ".", str(stop)
    lines = [f"{n} (+{step})" for n in nums[:-1]]
    return prompt, "\n".join(["Counting up:", *lines, f"Done at {stop}."]), str(stop)


def _sort(rng: random.Random, phrasing: int, variant: str) -> tuple[str, str, str]:
    items = rng.sample(range(100), rng.randint(3, 7))
    listed = ", ".join(map(str, items))
    prompt = (f"Sort these numbers in ascending order: {listed}.", f"Put {listed} in increasing order.",
              f"Order from smallest to largest: {listed}.")[phrasing]
    ordered = sorted(items)
    answer = ", ".join(map(str, ordered))
    if variant == "base":
        steps = [f"The smallest is {ordered[0]}."] + [f"Next is {n}." for n in ordered[1:]]
        return prompt, "\n".join([*steps, f"Sorted: {answer}."]), answer
    return prompt, "\n".join([f"There are {len(items)} numbers.", "Ascending: " + " < ".join(map(str, ordered)),
                              f"Result: {answer}."]), answer


_RENDER = {"add": _add, "sub": _sub, "mul": _mul, "count": _count, "sort": _sort}


def make_example(seed: int, index: int, variant: str = "base") -> Example:
    """Example number `index` of the raw stream for `seed` (either split)."""
    _check(variant, "train")
    rng = random.Random(f"verl-speco-corpus:{seed}:{index}")
    task = rng.choices(TASKS, weights=_TASK_WEIGHTS)[0]
    phrasing = rng.randrange(3)
    prompt, response, answer = _RENDER[task](rng, phrasing, variant)
    return Example(task, prompt, response, answer)


def split_of(prompt: str) -> str:
    """"test" for prompts whose SHA-256 lands in bucket 0, else "train"."""
    bucket = int.from_bytes(hashlib.sha256(prompt.encode()).digest()[:8], "big") % _SPLIT_BUCKETS
    return "test" if bucket == 0 else "train"


def iter_examples(seed: int = 0, variant: str = "base", split: str = "train") -> Iterator[Example]:
    """Endless deterministic stream of the examples of `split` (train and test never share a prompt)."""
    _check(variant, split)
    index = 0
    while True:
        ex = make_example(seed, index, variant)
        index += 1
        if split_of(ex.prompt) == split:
            yield ex


def generate_examples(n: int, seed: int = 0, variant: str = "base", split: str = "train") -> list[Example]:
    """The first `n` examples of `iter_examples(seed, variant, split)`."""
    if n < 0:
        raise ValueError(f"n={n} must be >= 0")
    stream = iter_examples(seed, variant, split)
    return [next(stream) for _ in range(n)]
