import pytest

from verl_speco.target.corpus import generate_examples
from verl_speco.target.evaluate import score


def test_score_against_references() -> None:
    base = generate_examples(30, seed=1, split="test")
    shifted = generate_examples(30, seed=1, variant="shifted", split="test")
    perfect = score(base, [ex.response for ex in base])
    assert perfect["exact"] == perfect["first_line"] == perfect["answer"] == 1.0
    drifted = score(base, [ex.response for ex in shifted])  # right answers, other style
    assert drifted["exact"] == 0.0 and drifted["first_line"] == 0.0 and drifted["answer"] == 1.0
    wrong = score(base, [ex.response.replace(f"is {ex.answer}.", "is 9999999.") for ex in base])
    expected_hits = sum(ex.task in ("count", "sort") for ex in base)  # their last lines do not use "is N."
    assert wrong["answer"] == pytest.approx(expected_hits / 30)
    assert set(perfect["answer_by_task"]) == {ex.task for ex in base}


def test_score_length_mismatch() -> None:
    with pytest.raises(ValueError, match="len\\(outputs\\)=1"):
        score(generate_examples(2), ["x"])
