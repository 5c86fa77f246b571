"""scripts/drift_reachable.py on hand-made validation dumps with the embedded target's tokenizer (single-digit
tokens): the computed number's tokens are the only undraftable ones, a step's reachable acceptance is the
chain count over its answers, the table divides it by the measured initial acceptance and marks the steps
where it stays under 1.3, and a malformed dump line is refused with its file:line."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from file_modules import load_script

from drafters.common.metrics import reachable_chain_counts


@pytest.fixture(scope="module")
def tokenizer() -> Any:
    from transformers import AutoTokenizer

    from verl_speco.target.named import resolve_target

    return AutoTokenizer.from_pretrained(str(resolve_target("embedded")))


def test_only_the_computed_numbers_are_undraftable(tokenizer: Any) -> None:
    reach = load_script("drift_reachable")
    marks = reach.draftable_tokens(tokenizer, "What is 7 plus 4?", "7 + 4 = 11", 64)
    ids = tokenizer("7 + 4 = 11", add_special_tokens=False)["input_ids"]
    tokens = tokenizer.convert_ids_to_tokens(ids)
    assert len(marks) == len(ids) + 1 and marks[-1]  # the end-of-sequence token, drafted like any other
    assert [t for t, m in zip(tokens, marks) if not m] == tokens[-2:]  # "1", "1": the sum's two digits
    # the operands copy from the prompt; a number the prompt holds is draftable wherever it appears
    assert all(reach.draftable_tokens(tokenizer, "What is 9 minus 4? 5", "9 - 4 = 5", 64))
    # an answer cut at the length limit has no end-of-sequence token
    assert len(reach.draftable_tokens(tokenizer, "What is 7 plus 4?", "7 + 4 = 11", len(ids))) == len(ids)


def _dump(tmp: Path, steps: dict[int, list[tuple[str, str]]]) -> Path:
    valgen = tmp / "valgen"
    valgen.mkdir()
    for step, rows in steps.items():
        (valgen / f"{step}.jsonl").write_text("".join(json.dumps({"input": q, "output": a, "step": step}) + "\n"
                                                      for q, a in rows))
    return valgen


def test_table_divides_the_reachable_acceptance_by_the_initial_one(tmp_path: Path, tokenizer: Any,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    reach = load_script("drift_reachable")
    answers = {0: [("What is 7 plus 4?", "7 + 4 = 11"), ("What is 3 plus 5?", "3 + 5 = 8")],
               1: [("What is 6 minus 2?", "To find it, take 2 away from 6: 6 - 2 = 4. So the answer is 4.")]}
    valgen = _dump(tmp_path, answers)
    results = tmp_path / "metrics.jsonl"
    records = [{"arm": "cotrained", "step": 0, "heldout_acceptance": 2.9, "heldout_baseline_acceptance": 2.8},
               {"arm": "cotrained", "step": 1, "heldout_acceptance": 2.6, "heldout_baseline_acceptance": 1.5},
               {"arm": "frozen", "step": 1, "heldout_acceptance": 9.0, "heldout_baseline_acceptance": 9.0}]
    results.write_text("".join(json.dumps(r) + "\n" for r in records))
    table = reach.main(["--valgen", str(valgen), "--results", str(results), "--json", str(tmp_path / "t.json"),
                        "--png", str(tmp_path / "t.png")])
    for step, rows in answers.items():
        counts = [reachable_chain_counts(reach.draftable_tokens(tokenizer, q, a, 64), 3) for q, a in rows]
        expected = 1 + sum(a for a, _ in counts) / sum(d for _, d in counts)
        assert table[step]["reachable"] == pytest.approx(expected)
        initial = records[step]["heldout_baseline_acceptance"]
        assert table[step]["reachable_gain"] == pytest.approx(expected / initial)
        assert table[step]["gain"] == pytest.approx(records[step]["heldout_acceptance"] / initial)
    # short answers whose numbers are computed: 3.25 reachable, under 1.3 x the initial draft's 2.8
    assert table[0]["reachable"] == pytest.approx(3.25) and table[0]["reachable_gain"] < 1.3
    assert table[1]["reachable_gain"] > 1.3  # a long, mostly copied answer leaves room
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].split()[0] == "0" and lines[1].endswith(" <") and not lines[2].endswith(" <")
    assert json.loads((tmp_path / "t.json").read_text())["1"]["answers"] == 1
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not any(line.startswith("steps ") for line in lines)  # no step in the goal's window (from 4)
    reach.main(["--valgen", str(valgen), "--results", str(results), "--goal-from", "1"])
    # step 1 only: margin 2.6 - 1.5, gain 2.6 / 1.5 (experiments/drift_stats.py goal_window)
    assert capsys.readouterr().out.splitlines()[-1] == (
        "steps 1 to 1: margin 1.10 (sd 0.00), gain 1.733 min / 1.733 mean, 1 of 1 steps at 1.3 or more: the goal, met")


def test_a_malformed_dump_line_is_refused_with_its_place(tmp_path: Path) -> None:
    reach = load_script("drift_reachable")
    valgen = _dump(tmp_path, {3: [("q", "a")]})
    with open(valgen / "3.jsonl", "a") as fh:
        fh.write(json.dumps({"input": "q", "response": "a"}) + "\n")
    with pytest.raises(ValueError, match=r"3\.jsonl:2: expected string fields 'input' and 'output'"):
        reach.read_dumps(valgen)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="no <step>.jsonl files"):
        reach.read_dumps(tmp_path / "empty")
    with open(valgen / "3.jsonl", "w") as fh:
        fh.write(json.dumps({"input": "q", "output": "a"}) + "\n{truncated\n")
    with pytest.raises(ValueError, match=r"3\.jsonl:2: not a JSON line"):
        reach.read_dumps(valgen)
    (valgen / "3.jsonl").write_text("[1, 2]\n")
    with pytest.raises(ValueError, match=r"3\.jsonl:1: a JSON list; expected one JSON object per line"):
        reach.read_dumps(valgen)
