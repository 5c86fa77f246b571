"""metrics.jsonl on resume: records after the resumed step are dropped, a torn last line is repaired
(with a warning), a corrupt line before the end is an error naming file and line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from verl_speco.train.metrics_log import MetricsLogger, read_jsonl, truncate_jsonl


def _write(path: Path, steps: list[int], tail: bytes = b"") -> None:
    body = "".join(json.dumps({"step": s, "kind": "train", "loss": s / 10}) + "\n" for s in steps)
    path.write_bytes(body.encode() + tail)


def _steps(path: Path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


@pytest.mark.parametrize("tail", [b'{"step": 5, "kind": "tr', b"\0\0\0\0\0\0\0\0", b'{"step": 5}\0\0\0'])
def test_torn_last_line_is_dropped_with_a_warning(tmp_path: Path, tail: bytes) -> None:
    path = tmp_path / "metrics.jsonl"
    _write(path, [1, 2, 3], tail)
    with pytest.warns(UserWarning, match=r"metrics\.jsonl:4: .*torn"):
        truncate_jsonl(path, 3)
    assert _steps(path) == [1, 2, 3] and path.read_bytes().endswith(b"\n")
    _write(path, [1, 2, 3], tail)
    with pytest.warns(UserWarning, match="torn"):
        assert [r["step"] for r in read_jsonl(path)] == [1, 2, 3]
    _write(path, [1, 2, 3], tail + b"\n" + b'{"step": 4, "kind": "train"}')  # whole, if without newline
    with pytest.raises(ValueError, match=r"metrics\.jsonl:4: "):  # torn, then more: not a torn tail
        truncate_jsonl(path, 3)
    _write(path, [1, 2, 3], b'{"step": 4, "kind": "train"}')
    truncate_jsonl(path, 10)
    assert _steps(path) == [1, 2, 3, 4] and path.read_text().endswith("}\n")


def test_corrupt_line_before_the_end_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\n{"step": 2, "ki\n{"step": 3}\n')
    with pytest.raises(ValueError, match=r"metrics\.jsonl:2: .*not a JSON record"):
        truncate_jsonl(path, 3)
    path.write_text('{"step": 1}\n[1, 2]\n')
    with pytest.raises(ValueError, match=r"metrics\.jsonl:2: .*step"):
        truncate_jsonl(path, 3)


def test_logger_appends_after_a_repaired_file(tmp_path: Path) -> None:
    _write(tmp_path / "metrics.jsonl", [1, 2, 3], b'{"step": 4, "kind"')
    with pytest.warns(UserWarning, match="torn"):
        logger = MetricsLogger(tmp_path, True, 3, 10, tensorboard=False, progress_bar=False)
    logger.log(4, "train", {"loss": 0.5})
    logger.close()
    assert _steps(tmp_path / "metrics.jsonl") == [1, 2, 3, 4]
