"""The inspector on real stores: the summary and JSON report, leftovers, progress bar, the console script."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import make_sample, write_store

from feature_store import inspect as inspect_mod
from feature_store.inspect import main
from feature_store.store import SHARDS_DIR, list_commits


def test_summary_counts_match_what_was_written(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    write_store(tmp_path, list(range(30)), rank=0, flush_samples=8)
    write_store(tmp_path, list(range(30, 45)), rank=3, flush_samples=8)
    capsys.readouterr()
    assert main([str(tmp_path), "--json", "--max-samples", "0", "--verify-checksums"]) == 0
    rep = json.loads(capsys.readouterr().out)
    tokens = sum(int(make_sample(u)["input_ids"].shape[0]) for u in range(45))
    files = [p for p in (tmp_path / SHARDS_DIR).iterdir() if p.suffix == ".safetensors"]
    s = rep["summary"]
    assert (s["samples"], s["tokens"], s["shards"], s["writers"], s["ranks"]) == (45, tokens, 4 + 2, 2, [0, 3])
    assert s["bytes"] == sum(p.stat().st_size for p in files)
    assert s["step_range"] == [0, 4] and s["policy_version_range"] == [0, 2]
    assert s["layout"]["layer_ids"] == [2, 4, 5] and s["target_model_id"] == "test/tiny"
    assert rep["samples_checked"] == 45 and rep["ok"] is True and rep["errors"] == []
    assert main([str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "samples          45" in text and f"tokens           {tokens}" in text and "result: CLEAN" in text
    assert main([str(tmp_path), "--json", "--max-samples", "10"]) == 0
    assert json.loads(capsys.readouterr().out)["samples_checked"] == 10


def test_commit_counts_disagreeing_with_shard(store: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rec = list_commits(store)[1]
    path = store / SHARDS_DIR / (rec.name + ".commit.json")
    d = json.loads(path.read_text())
    d["num_tokens"] += 1
    path.unlink()
    path.write_text(json.dumps(d))
    capsys.readouterr()
    assert main([str(store), "--json"]) == 1
    errors = json.loads(capsys.readouterr().out)["errors"]
    assert [e["kind"] for e in errors] == ["commit_mismatch"] and rec.shard in errors[0]["where"]


def test_progress_bar_on_stderr_for_large_stores(store: Path, capsys: pytest.CaptureFixture[str],
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    capsys.readouterr()
    assert main([str(store), "--json"]) == 0
    assert "shards" not in capsys.readouterr().err                       # small store: no bar
    monkeypatch.setattr(inspect_mod, "LARGE_SHARDS", 2)
    assert main([str(store), "--json"]) == 0
    out = capsys.readouterr()
    assert "shards: 100%" in out.err and "samples: 100%" in out.err
    json.loads(out.out)                                                   # stdout stays pure JSON
    assert main([str(store), "--no-progress"]) == 0
    assert "100%" not in capsys.readouterr().err


def test_console_script(store: Path) -> None:
    exe = Path(sys.executable).with_name("verl-speco-inspect-features")
    if not exe.exists():
        pytest.skip("console script not installed (pip install -e .)")
    ok = subprocess.run([str(exe), str(store), "--json"], capture_output=True, text=True)
    assert ok.returncode == 0 and json.loads(ok.stdout)["summary"]["samples"] == 50
