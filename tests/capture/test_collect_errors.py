"""User errors of `verl-speco-collect` (the real CLI in a subprocess): one line
`verl-speco-collect: error: ...` naming the file and line (data) or the path (target), exit 2, no
traceback; the data file is checked before the target is loaded."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
GOOD = json.dumps({"messages": [{"role": "user", "content": "w1 w2"}, {"role": "assistant", "content": "w3"}]})


def collect_failing(target: Path, data: Path, store: Path) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "verl_speco.capture.collect", "--target", str(target),
                           "--data", str(data), "--store", str(store), "--layers", "2,4"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 2, f"exit {proc.returncode}\nstdout:\n{proc.stdout[-2000:]}\nstderr:\n{proc.stderr[-4000:]}"
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]
    lines = [line for line in proc.stderr.splitlines() if "error:" in line]
    assert len(lines) == 1 and lines[0].startswith("verl-speco-collect: error: "), proc.stderr[-4000:]
    assert not store.exists()  # nothing written
    return lines[0]


@pytest.mark.parametrize("messages", ["w1 w2", ["w1 w2"], [{"role": "user", "content": "w1"}, 3]])
def test_messages_not_a_list_of_objects(messages: object, target_dir: Path, tmp_path: Path) -> None:
    data = tmp_path / "chats.jsonl"
    data.write_text(f"{GOOD}\n{json.dumps({'messages': messages})}\n")
    line = collect_failing(target_dir, data, tmp_path / "store")
    assert f"{data}:2: " in line and "messages" in line and "list of objects" in line


def test_non_utf8_line_names_file_and_line(target_dir: Path, tmp_path: Path) -> None:
    data = tmp_path / "chats.jsonl"
    data.write_bytes(f"{GOOD}\n{GOOD}\n".encode() + b'{"messages": "caf\xe9"}\n')
    line = collect_failing(target_dir, data, tmp_path / "store")
    assert f"{data}:3: " in line and "UTF-8" in line


def test_target_that_is_not_a_model_is_named(tmp_path: Path) -> None:
    data = tmp_path / "chats.jsonl"
    data.write_text(GOOD + "\n")
    not_a_model = tmp_path / "not_a_model"
    not_a_model.mkdir()
    (not_a_model / "notes.txt").write_text("hello")
    line = collect_failing(not_a_model, data, tmp_path / "store")
    assert f"--target {str(not_a_model)!r}" in line and "config.json" in line


def test_data_is_checked_before_the_target_is_loaded(target_dir: Path, tmp_path: Path) -> None:
    broken = shutil.copytree(target_dir, tmp_path / "broken_target")
    (broken / "model.safetensors").write_bytes(b"not safetensors")  # loading it would fail
    data = tmp_path / "chats.jsonl"
    data.write_text(f"{GOOD}\n{{not json\n")
    line = collect_failing(broken, data, tmp_path / "store")
    assert f"{data}:2: " in line and "JSON" in line


def test_vllm_generation_reserves_a_small_cpu_kv_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM CPU sizes its KV cache from VLLM_CPU_KVCACHE_SPACE; unset, it reserves 92% of the machine's
    memory and refuses to start when another process holds some (`verl-speco-collect --engine vllm`
    beside a running benchmark did). The engine is built with 1 GiB unless the user chose a size."""
    from verl_speco.capture import generate
    from verl_speco.engines import vllm_engine

    seen: list[tuple[str | None, str | None]] = []

    class Built(Exception):
        pass

    def build_llm(*args: object, **kwargs: object) -> None:
        seen.append((os.environ.get("VLLM_CPU_KVCACHE_SPACE"), os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING")))
        raise Built

    monkeypatch.setattr(vllm_engine, "build_llm", build_llm)
    for user in (None, "6"):
        monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
        if user is None:
            monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
        else:
            monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", user)
        with pytest.raises(Built):
            generate.generate_responses_vllm("unused", [[1, 2, 3]], end_ids=[0], max_new_tokens=4)
    assert seen == [("1", "0"), ("6", "0")]
