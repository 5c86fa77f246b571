"""scripts/bench_train_step.py --shapes qwen3-8b: the preset reads the recipe catalog, names every
reduction, and its code path (frozen bf16 target tensors, one-side child arguments) runs at tiny shapes."""

from __future__ import annotations

import argparse
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from file_modules import load_script

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from benchmarks import train_step_shapes as shapes  # noqa: E402
from verl_speco.launchers import recipes  # noqa: E402

TINY = ["--hidden", "64", "--heads", "4", "--kv-heads", "2", "--intermediate", "128", "--vocab", "512",
        "--draft-vocab", "128", "--seq-len", "48", "--num-anchors", "4", "--markov-rank", "8",
        "--context-layers", "3", "--threads", "1"]


def _bench() -> Any:
    return load_script("bench_train_step")


def test_preset_reads_the_catalog(monkeypatch: pytest.MonkeyPatch) -> None:
    values = {f: {k: s.value for k, s in shapes.recipe(f).items()} for f in ("eagle3", "dflash", "dspark", "peagle")}
    spec = recipes.QWEN3_8B
    for f, v in values.items():
        assert (v["hidden"], v["heads"], v["kv_heads"], v["intermediate"], v["vocab"]) == (
            spec.hidden_size, spec.num_attention_heads, spec.num_key_value_heads, spec.intermediate_size,
            spec.vocab_size), f
        assert v["batch"] == 1 and v["dtype"] == "bfloat16", f
    gpu = {f: recipes.drafter_recipe(f, "gpu") for f in ("eagle3", "dspark", "peagle")}
    assert values["eagle3"]["draft_vocab"] == gpu["eagle3"]["draft_vocab_size"] == 32000
    assert values["eagle3"]["ttt_steps"] == gpu["eagle3"]["ttt_steps"] == 7
    assert values["eagle3"]["seq_len"] == 4096  # configs/preset/qwen3_8b_eagle3.yaml
    assert values["dflash"]["seq_len"] == 2048 and values["dflash"]["num_anchors"] == 512
    assert values["dspark"]["block_size"] == gpu["dspark"]["block_size"] == 7
    assert values["peagle"]["peagle_layers"] == gpu["peagle"]["num_layers"] == 4
    # planted: a changed catalog value changes the preset
    real = recipes.drafter_recipe

    def planted_recipe(family: str, name: str) -> dict[str, Any]:
        changed = {"block_size": 12, "num_layers": 3} if (family, name) == ("dflash", "gpu") else {}
        return {**real(family, name), **changed}

    monkeypatch.setattr(recipes, "drafter_recipe", planted_recipe)
    monkeypatch.setattr(recipes, "QWEN3_8B", replace(spec, hidden_size=2048, num_attention_heads=16))
    planted = shapes.recipe("dflash")
    assert (planted["block_size"].value, planted["layers"].value, planted["hidden"].value) == (12, 3, 2048)
    assert shapes.preset("dflash", cpu_fit=True)["layers"].recipe == 3


def test_cpu_fit_reductions_are_named_in_the_header() -> None:
    bench = _bench()
    args = bench.parse_args(["--shapes", "qwen3-8b", "--family", "all", "--seq-len", "768"])
    text = "\n".join(args.header)
    for family, key in (("dflash", "layers"), ("dspark", "layers"), ("peagle", "peagle_layers"),
                        ("dflash", "num_anchors"), ("eagle3", "frozen_dtype")):
        assert f"[{family}]   REDUCED {key}: recipe" in text, (family, key, text)
    assert "[eagle3]   seq_len=768 set by its flag" in text  # explicit flags win and are named
    dflash = args.per_family["dflash"]
    assert (dflash.hidden, dflash.vocab, dflash.layers, dflash.block_size, dflash.seq_len) == (4096, 151936, 1, 16,
                                                                                              768)
    assert args.isolate and args.ours_alone
    alone = args.alone["dflash"]  # the recipe's full length, our side only
    assert (alone.seq_len, alone.num_anchors, alone.side, alone.steps) == (2048, 512, "ours", 0)
    full = bench.parse_args(["--shapes", "qwen3-8b", "--family", "dflash", "--no-cpu-fit"]).per_family["dflash"]
    assert (full.layers, full.seq_len, full.num_anchors, full.frozen_dtype) == (5, 2048, 512, "float32")
    default = bench.parse_args(["--family", "dflash"])
    assert default.per_family["dflash"] is default and not default.isolate and default.header == []


def test_bad_input_names_the_flag(capsys: pytest.CaptureFixture[str]) -> None:
    bench = _bench()
    with pytest.raises(SystemExit):
        bench.parse_args(["--family", "dflash", "--frozen-dtype", "bfloat16"])
    assert "--frozen-dtype: got bfloat16, expected float32 with --dtype float32" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.parse_args(["--ours-alone"])
    assert "--ours-alone: got it with --shapes default" in capsys.readouterr().err


def test_tiny_qwen3_preset_path_runs(capsys: pytest.CaptureFixture[str]) -> None:
    """The preset's code path at tiny explicit shapes: bf16 frozen target tensors, one side per run (as
    an isolated child), and the child's flags reproduce the resolved arguments."""
    bench = _bench()
    argv = ["--shapes", "qwen3-8b", "--family", "dflash", *TINY, "--steps", "1", "--warmup", "1"]
    args = bench.parse_args(argv)
    fam = args.per_family["dflash"]
    child = bench.parse_args(bench.child_argv(args.parser, fam, "dflash", "speculators"))
    for key in ("hidden", "vocab", "layers", "block_size", "num_anchors", "frozen_dtype", "dtype", "seq_len"):
        assert getattr(child.per_family["dflash"], key) == getattr(fam, key), key
    assert child.side == "speculators" and fam.frozen_dtype == "bfloat16" and fam.layers == 1
    ours = argparse.Namespace(**{**vars(fam), "side": "ours"})
    assert bench.run_family("dflash", ours) is None
    out = capsys.readouterr().out
    line = next(x for x in out.splitlines() if x.startswith(bench.RESULT_TAG))
    result = bench.json.loads(line[len(bench.RESULT_TAG):])
    assert result["check_ok"] is True and result["stats"]["name"] == "ours"
    assert len(result["stats"]["losses"]) == 1 and result["stats"]["peak_mb"] is not None
    assert "frozen target tensors cast to bfloat16" in out


def test_domino_step_alone_runs_and_reports(tmp_path: Path) -> None:
    """scripts/bench_domino_step.py (Domino has no speculators counterpart): the bench's step, data and
    step-peak machinery on our side alone, one result line with finite step times."""
    import json
    import math
    import subprocess

    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_domino_step.py"), *TINY, "--layers", "1",
                           "--steps", "1", "--warmup", "1"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    bench = _bench()
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith(bench.RESULT_TAG)]
    stats = json.loads(line[len(bench.RESULT_TAG):])["stats"]
    assert stats["name"] == "ours" and stats["trainable"] > 0 and all(math.isfinite(x) for x in stats["losses"])
    assert stats["times"]["step"] and all(t > 0 for t in stats["times"]["step"])
