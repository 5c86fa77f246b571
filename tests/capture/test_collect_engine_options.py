"""`verl-speco-collect --engine vllm` engine flags: --engine-dtype, --enforce-eager / --no-enforce-eager
and --max-num-seqs reach the vLLM generation (a recorder in its place, the rest of the collection real,
on the tiny target); unset, nothing is passed (the device defaults of `vllm_engine.build_llm` apply);
given without --engine vllm --generate, or out of range, they fail naming the flag."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from verl_speco.capture import collect
from verl_speco.capture.generate import Generated

CHATS = [[{"role": "user", "content": "w1 w2 w3"}, {"role": "assistant", "content": "w4 w5"}],
         [{"role": "user", "content": "w6"}, {"role": "assistant", "content": "w7 w8 w9"}]]


@pytest.fixture
def data(tmp_path: Path) -> Path:
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CHATS))
    return path


def run(monkeypatch: pytest.MonkeyPatch, target_dir: Path, data: Path, store: Path, *flags: str) -> dict[str, Any]:
    seen: list[dict[str, Any]] = []

    def generate(target: str, prompts: list[list[int]], **kwargs: Any) -> list[Generated]:
        seen.append(kwargs)
        return [Generated([5, 6, 7], False) for _ in prompts]

    monkeypatch.setattr(collect, "generate_responses_vllm", generate)
    argv = ["--target", str(target_dir), "--data", str(data), "--store", str(store), "--generate", "--engine", "vllm",
            "--layer-ids", "1,2", "--max-new-tokens", "3", *flags]
    assert collect.main(argv) == 0
    [kwargs] = seen
    return kwargs


def test_the_flags_reach_the_engine(monkeypatch: pytest.MonkeyPatch, target_dir: Path, data: Path, tmp_path: Path) -> None:
    given = run(monkeypatch, target_dir, data, tmp_path / "a", "--engine-dtype", "float16", "--no-enforce-eager",
                "--max-num-seqs", "64")
    assert {k: given[k] for k in ("dtype", "enforce_eager", "max_num_seqs")} == \
        {"dtype": "float16", "enforce_eager": False, "max_num_seqs": 64}
    eager = run(monkeypatch, target_dir, data, tmp_path / "b", "--enforce-eager")
    assert eager["enforce_eager"] is True and "dtype" not in eager and "max_num_seqs" not in eager
    default = run(monkeypatch, target_dir, data, tmp_path / "c")
    assert not {"dtype", "enforce_eager", "max_num_seqs"} & set(default)  # build_llm's device defaults


@pytest.mark.parametrize(("flags", "expected"), [
    (["--engine", "hf", "--generate", "--engine-dtype", "bfloat16"],
     "--engine-dtype: apply to --engine vllm with --generate, got --engine hf"),
    (["--engine", "vllm", "--max-num-seqs", "4", "--enforce-eager"],
     "--enforce-eager, --max-num-seqs: apply to --engine vllm with --generate, got --engine vllm without --generate"),
    (["--engine", "vllm", "--generate", "--max-num-seqs", "0"], "--max-num-seqs 0: expected >= 1"),
])
def test_misplaced_or_bad_flags_fail_naming_them(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                 flags: list[str], expected: str) -> None:
    argv = ["--target", str(tmp_path / "none"), "--data", str(tmp_path / "none.jsonl"), "--store", str(tmp_path / "s"),
            *flags]
    assert collect.main(argv) == 2
    err = capsys.readouterr().err
    assert err.startswith("verl-speco-collect: error: ") and expected in err, err
    assert not (tmp_path / "s").exists()


def test_a_bad_dtype_is_refused_by_the_parser(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        collect.main(["--target", "t", "--data", "d", "--store", "s", "--engine-dtype", "fp8"])
    assert exit_.value.code == 2 and "--engine-dtype: invalid choice: 'fp8'" in capsys.readouterr().err
