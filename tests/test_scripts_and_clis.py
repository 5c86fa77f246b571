"""Every script in scripts/ and every console script answers --help (or parses, for shell); the
training-step benchmark also runs end to end at its --quick shapes."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
from file_modules import load_script

ROOT = Path(__file__).resolve().parents[1]
PY_SCRIPTS = sorted((ROOT / "scripts").glob("*.py"))
SH_SCRIPTS = sorted((ROOT / "scripts").glob("*.sh")) + [ROOT / ".ci" / "run"]
CONSOLE = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]


@pytest.mark.parametrize("script", PY_SCRIPTS, ids=lambda p: p.name)
def test_python_script_help(script: Path) -> None:
    out = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, cwd=ROOT,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert "usage:" in out.stdout


@pytest.mark.parametrize("script", SH_SCRIPTS, ids=lambda p: p.name)
def test_shell_script_parses(script: Path) -> None:
    out = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert "set -euo pipefail" in script.read_text()


@pytest.mark.parametrize("name", sorted(CONSOLE))
def test_console_script_help(name: str) -> None:
    module, func = CONSOLE[name].split(":")
    code = f"import sys; from {module} import {func}; sys.exit({func}(['--help']))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "usage:" in out.stdout and name in out.stdout


def test_ci_runs_the_readme_test_command() -> None:
    readme = (ROOT / "README.md").read_text()
    assert "bash scripts/run_tests.sh" in readme and "bash scripts/quickstart.sh" in readme
    assert "bash scripts/run_tests.sh" in (ROOT / ".ci" / "run").read_text()


def test_bench_train_step_quick_every_family() -> None:
    """`bench_train_step.py --quick --family all` runs every family's adapter end to end: the summary
    table has one row per family with a numeric ratio, finite losses on both sides and an OK check."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from benchmarks.train_step_adapters import ADAPTERS

    out = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_train_step.py"), "--quick", "--family", "all",
                          "--no-memory"], capture_output=True, text=True, cwd=ROOT, timeout=600,
                         env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert out.returncode == 0, out.stdout[-6000:] + out.stderr[-6000:]
    lines = out.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("family "))
    columns = lines[header].split()
    rows = {}
    for line in lines[header + 1:]:
        cells = line.split()
        if len(cells) != len(columns):
            break
        rows[cells[0]] = dict(zip(columns, cells))
    assert sorted(rows) == sorted(ADAPTERS), lines[header:]
    for name, row in rows.items():
        ratio = float(row["ratio"])
        assert math.isfinite(ratio) and ratio > 0, (name, row)
        assert all(math.isfinite(float(row[k])) for k in ("ours_loss", "spec_loss", "ours_ms", "spec_ms")), (name, row)
        assert row["check"] == "OK", (name, row)
        assert row["ours_params"] == row["spec_params"], (name, row)
        assert row["verdict"] in ("GOAL", "PASS", "FAIL"), (name, row)


def _bench_family_module() -> Any:
    return load_script("bench_family_acceptance")


def test_bench_family_acceptance_table_and_chart(tmp_path: Path) -> None:
    """`bench_family_acceptance.py` covers all seven families (P-EAGLE trained with num_depths = k and
    served by vLLM as eagle3 + parallel_drafting), and its table/chart render every column from a
    report (no training here: the end-to-end run is the README's benchmark)."""
    bench = _bench_family_module()
    assert set(bench.FAMILIES) == {"eagle1", "eagle2", "eagle3", "dflash", "dspark", "domino", "peagle"}
    assert bench._depth_settings("peagle", 3) == ["drafter.settings.num_depths=3"]
    assert bench._depth_settings("dflash", 3) == ["drafter.settings.block_size=4"]
    assert bench._depth_settings("dspark", 7) == ["drafter.settings.block_size=7"]
    assert bench._depth_settings("eagle3", 3) == []
    assert bench._parser().parse_args([]).steps == 120
    k, tree = 3, {"top_k": 4, "depth": 3, "total_tokens": 16}
    assert bench.drafting_cost("peagle", k, None)["draft_forwards"] == 1
    assert bench.drafting_cost("eagle3", k, None)["draft_forwards"] == k
    assert bench.drafting_cost("eagle2", k, tree)["tokens_per_target_forward"] == 16
    assert bench.drafting_cost("dspark", k, None)["head_steps"] == k

    def acc(m: float) -> dict[str, Any]:
        return {"mean_acceptance_length": m, "num_drafts": 10, "num_draft_tokens": 30}

    families: dict[str, Any] = {}
    for i, fam in enumerate([*bench.FAMILIES, "eagle3 (tree)"]):
        name = fam.removesuffix(" (tree)")
        row_tree = tree if name == "eagle2" or fam != name else None
        row: dict[str, Any] = {"tree": row_tree, "tokens_seen": 1000, "trainable_params": 1000 + i,
                               "frozen_params": 64 if "eagle" in name else 0, "step_ms_median": 10.0 + i,
                               "greedy": acc(2.0 + i / 10), "t1": acc(1.9 + i / 10),
                               "cost": bench.drafting_cost(name, k, row_tree)}
        if row_tree is None:
            row["t1_sampled_drafts"] = acc(1.8 + i / 10)
        if name in ("dspark", "domino"):
            row["vllm_unservable"] = "reason"
        elif name in bench.VLLM_METHOD and fam == name:
            row["vllm_greedy"] = {**acc(2.0 + i / 10), "lossless": True}
            row["vllm_t1"] = acc(1.9 + i / 10)
        families[fam] = row
    families["eagle1"]["greedy"].update(tokens_per_target_forward=2.4243, tokens_per_target_forward_interval90=[2.3112, 2.5409])
    families["eagle3"]["greedy"].update(tokens_per_target_forward=1.61)  # a decode cached before intervals
    report = {"k": k, "steps": 120, "train_prompts": 512, "eval_prompts": 16, "max_new_tokens": 96,
              "timing": {"warmup_steps": 3, "timed_steps": 20, "batch_sequences": 8, "torch_threads": 2},
              "families": families}
    text = bench.table(report)
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    header = rows[0].split("|")
    assert "trainable params" in rows[0] and "train step, ms: CPU (wall)" in rows[0] and "draft forwards / round" in rows[0]
    assert len(rows) == 1 + len(families)
    assert all(len(r.split("|")) == len(header) for r in rows[1:])
    assert "| 2.424 (2.31-2.54) |" in next(r for r in rows if r.startswith("| eagle1 |"))
    assert "| 1.610 |" in next(r for r in rows if r.startswith("| eagle3 |"))
    peagle = next(r for r in rows if r.startswith("| peagle |"))
    assert "eagle3 + parallel_drafting" in peagle and "lossless yes" in peagle
    assert "V1 runner refuses it" in next(r for r in rows if r.startswith("| dspark |"))
    assert "no Domino" in next(r for r in rows if r.startswith("| domino |"))
    assert "Trainable params" in text and "8 sequences" in text and "not timed" not in text
    untimed = bench.table({**report, "timing": {"warmup_steps": 3, "timed_steps": 0, "batch_sequences": None}})
    assert "Train step: not timed in this run (--time-steps 0)" in untimed and "None" not in untimed
    png = bench.plot(report, tmp_path / "chart.png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    from benchmarks.family_table import chart_series  # importable once the script put the root on sys.path

    assert [key for _, key in chart_series(report)] == ["greedy", "t1", "t1_sampled_drafts"]
    greedy_only = {**report, "families": {name: {"greedy": fam["greedy"]} for name, fam in families.items()}}
    assert [key for _, key in chart_series(greedy_only)] == ["greedy"]
    assert bench.plot(greedy_only, tmp_path / "greedy.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_family_acceptance_decode_cache_is_keyed_by_export_bytes(tmp_path: Path) -> None:
    """A stopped comparison resumes from cached decoding runs, but only while the export's bytes and
    the decoding settings are the same: a retrained export or another seed decodes again, and a run
    whose engine failed is not cached."""
    bench = _bench_family_module()
    export = tmp_path / "export"
    export.mkdir()
    (export / "model.safetensors").write_bytes(b"one")
    args = bench._parser().parse_args(["--k", "3"])
    calls: list[int] = []

    def compute(errors: dict[str, str] | None = None) -> dict[str, Any]:
        calls.append(1)
        return {"mean_acceptance_length": 1.0 + len(calls), "outputs": [[1, 2]], "tree": None,
                **({"errors": errors} if errors else {})}

    first = bench._cached(tmp_path, "eagle3_greedy", args, [export], compute)
    assert first["mean_acceptance_length"] == 2.0 and "outputs" not in first
    assert bench._cached(tmp_path, "eagle3_greedy", args, [export], compute) == first and len(calls) == 1
    (export / "model.safetensors").write_bytes(b"two")
    assert bench._cached(tmp_path, "eagle3_greedy", args, [export], compute)["mean_acceptance_length"] == 3.0
    args.seed += 1
    assert bench._cached(tmp_path, "eagle3_greedy", args, [export], compute)["mean_acceptance_length"] == 4.0
    failed = lambda: compute({"peagle": "engine died"})  # noqa: E731
    bench._cached(tmp_path, "vllm", args, [export], failed, drop=False)
    bench._cached(tmp_path, "vllm", args, [export], failed, drop=False)
    assert len(calls) == 5



def test_bench_family_acceptance_store_is_named_by_its_collection_recipe(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """The collected store is reused only for the same recipe: another response cap
    (--collect-new-tokens, which defaults to --max-new-tokens) or another prompt set collects a new
    store beside it; a store left part way (no done marker) is removed and collected again; the
    marker records the recipe."""
    import dataclasses
    import json

    from verl_speco.capture import collect as collect_module
    from verl_speco.console import Console

    bench = _bench_family_module()
    calls: list[tuple[Path, int]] = []

    @dataclasses.dataclass
    class Summary:
        rows: int

    def fake_collect(target: Path, jsonl: Path, store: Path, **kw: Any) -> Summary:
        assert not store.exists(), "a part-way store must be removed before collecting again"
        store.mkdir(parents=True)
        calls.append((store, kw["max_new_tokens"]))
        return Summary(rows=len(calls))

    monkeypatch.setattr(collect_module, "collect_features", fake_collect)

    def collect(*argv: str) -> dict[str, Path]:
        args = bench._parser().parse_args(["--train-prompts", "4", "--eval-prompts", "2", "--out", str(tmp_path),
                                           *argv])
        return bench._collect(args, ["eagle1"], tmp_path / "target", tmp_path, Console(None, bars=False))

    first = collect("--max-new-tokens", "16")
    assert [cap for _, cap in calls] == [16, 16] and first["train"].name.startswith("train-")
    assert collect("--max-new-tokens", "16") == first and len(calls) == 2
    assert collect("--max-new-tokens", "16", "--collect-new-tokens", "16") == first and len(calls) == 2
    longer = collect("--max-new-tokens", "16", "--collect-new-tokens", "48")
    assert longer["train"] != first["train"] and [cap for _, cap in calls[2:]] == [48, 48]
    recipe = json.loads((longer["train"].parent / f"{longer['train'].name}.done").read_text())
    assert recipe["max_new_tokens"] == 48 and longer["train"].name == f"train-{recipe['digest']}"
    assert recipe["summary"] == {"rows": 3}
    more = collect("--max-new-tokens", "16", "--train-prompts", "5")
    assert more["train"] != first["train"] and more["eval"] == first["eval"]
    (first["train"].parent / f"{first['train'].name}.done").unlink()  # planted: a stopped collection
    (first["train"] / "partial.safetensors").write_bytes(b"x")
    assert collect("--max-new-tokens", "16") == first and calls[-1] == (first["train"], 16)
    assert not (first["train"] / "partial.safetensors").exists()

    # --grow-store: the train store grows from the 4-prompt one, collecting only prompts 5 and 6
    added: list[tuple[Path, list[str]]] = []

    def grow_collect(target: Path, jsonl: Path, store: Path, **kw: Any) -> Summary:
        added.append((store, jsonl.read_text().splitlines()))
        return Summary(rows=len(added[-1][1]))

    monkeypatch.setattr(collect_module, "collect_features", grow_collect)
    six = tmp_path / "data" / "train.jsonl"
    grown = collect("--max-new-tokens", "16", "--train-prompts", "6", "--grow-store", str(first["train"]))
    assert [rows for _, rows in added] == [six.read_text().splitlines()[4:]] and added[0][0] == grown["train"]
    assert grown["eval"] == first["eval"]                   # only the train store grows
    marker = json.loads((grown["train"].parent / f"{grown['train'].name}.done").read_text())
    base = json.loads((first["train"].parent / f"{first['train'].name}.done").read_text())
    assert marker["base_rows"] == 4 and marker["grown_from"] == base["digest"]
    assert marker["summary"] == {"base": base["summary"], "added": {"rows": 2}}


def test_bench_family_acceptance_real_target_overrides_compose(tmp_path: Path) -> None:
    """Every family's overrides for a real target (depth settings + its real_target recipe) compose
    into a trainer config with the values asked for (P-EAGLE's preset lacks draft_vocab_size: the
    override must add it), at both k of the README's tables."""
    from verl_speco.train.compose import load_config

    bench = _bench_family_module()
    args = bench._parser().parse_args(["--target", "smollm2-135m"])
    stores = {"train": tmp_path / "train", "eval": tmp_path / "eval"}
    for family in ("eagle1", "eagle3", "dflash", "dspark", "domino", "peagle"):
        for k in (3, 7):
            extra = bench._depth_settings(family, k) + bench._target_settings(family, args.target)
            cfg = load_config(bench._overrides(args, family, tmp_path / "target", stores, tmp_path / "run", extra))
            settings = cfg.drafter.settings
            if family in ("eagle3", "peagle"):
                assert settings["draft_vocab_size"] == 8192, family
            if family in ("dflash", "dspark", "domino"):
                assert settings["num_anchors"] == 64, family
    assert bench._target_settings("eagle3", "embedded") == []
    assert bench._eval_sets(None, ["sharegpt", "humaneval"]) == ["sharegpt", "humaneval"]
    assert bench._eval_sets("humaneval", ["sharegpt", "humaneval"]) == ["humaneval"]
    with pytest.raises(SystemExit, match=r"--eval-sets: got 'mmlu'"):
        bench._eval_sets("mmlu", ["sharegpt", "humaneval"])


def test_bench_family_acceptance_encoding_trains_from_an_fp8_twin(tmp_path: Path) -> None:
    """--encoding fp8_e4m3 transcodes the collected train and eval stores once (the same samples) and
    names every result apart from the raw run's; raw leaves the stores as collected."""
    import torch

    from feature_store import Layout, StoreWriter, load_store, standard_schema

    bench = _bench_family_module()
    schema = standard_schema(Layout((1,)), hidden_size=8, vocab_size=50, target_model_id="t")
    stores = {}
    for name in ("train", "eval"):
        with StoreWriter(tmp_path / name, schema) as w:
            w.add({"input_ids": torch.arange(4), "loss_mask": torch.ones(4, dtype=torch.uint8),
                   "aux_hidden": torch.randn(4, 8).bfloat16(), "last_hidden": torch.randn(4, 8).bfloat16()}, step=0)
        stores[name] = tmp_path / name
    raw = bench._parser().parse_args([])
    assert bench._encoded(raw, stores) == stores and bench._suffix(raw) == ""
    args = bench._parser().parse_args(["--encoding", "fp8_e4m3"])
    twins = bench._encoded(args, {**stores, "eval_jsonl:sharegpt": tmp_path / "p.jsonl"})
    assert twins["train"] == tmp_path / "train_fp8_e4m3" and twins["eval_jsonl:sharegpt"] == tmp_path / "p.jsonl"
    assert load_store(twins["eval"]).schema.field("aux_hidden").encoding == "fp8_e4m3"
    made = twins["train"].stat().st_mtime_ns
    assert bench._encoded(args, stores)["train"] == twins["train"] and twins["train"].stat().st_mtime_ns == made
    marker = json.loads((tmp_path / "train_fp8_e4m3.done").read_text())
    assert marker == {"source": "train", "encoding": "fp8_e4m3", "summary": {"samples": 1}}
    (tmp_path / "train_fp8_e4m3.done").unlink()  # planted: a transcode stopped before its marker
    assert bench._encoded(args, stores)["train"] == twins["train"] and twins["train"].stat().st_mtime_ns != made
    with pytest.raises(SystemExit):
        bench._parser().parse_args(["--encoding", "int4"])
    subset = bench._parser().parse_args(["--families", "eagle3", "--collect-for", ",".join(bench.FAMILIES)])
    assert bench._collect_for(subset, ["eagle3"]) == list(bench.FAMILIES)
    assert bench._collect_for(raw, ["eagle3"]) == ["eagle3"]
    with pytest.raises(SystemExit, match="holding every one of --families"):
        bench._collect_for(bench._parser().parse_args(["--collect-for", "eagle1"]), ["eagle3"])


def test_bench_family_acceptance_train_set_reaches_the_config_and_names_results(tmp_path: Path) -> None:
    """--train-set overrides reach every trained family's config, key its training cache, name its
    results apart from the default run's, and a misspelt key or an out-of-range value is refused by
    name before anything starts."""
    from verl_speco.train.compose import load_config

    bench = _bench_family_module()
    out = ["--out", str(tmp_path), "--target", "smollm2-135m"]
    args = bench._parser().parse_args([*out, "--train-set", "drafter.settings.prob_weight=1.0",
                                       "--train-set", "optim.lr=3e-4"])
    bench._check_train_set(args, ["eagle1", "eagle2"])
    cfg = load_config(bench._overrides(args, "eagle1", tmp_path / "t", {"train": tmp_path / "s", "eval": tmp_path / "e"},
                                       tmp_path / "run", bench._train_settings(args, "eagle1")))
    assert (cfg.drafter.settings["prob_weight"], cfg.optim.lr) == (1.0, 3e-4)
    assert bench._suffix(args) == "_prob_weight1.0_lr3e-4"
    fp8 = bench._parser().parse_args([*out, "--encoding", "fp8_e4m3", "--train-set", "drafter.settings.feature_noise=0"])
    assert bench._suffix(fp8) == "_fp8_e4m3_feature_noise0"
    assert bench._suffix(bench._parser().parse_args(out)) == ""
    assert bench._tree_tag(bench._parser().parse_args(out)) == ""
    assert bench._tree_tag(bench._parser().parse_args([*out, "--top-k", "10", "--total-tokens", "60"])) == "_tree60top10"
    for bad, said in (("drafter.settings.prob_wieght=1.0", "prob_wieght"), ("drafter.settings.prob_weight=-1",
                                                                          "prob_weight: got -1.0"),
                      ("optim.lr=fast", "optim.lr='fast'"), ("prob_weight", "expected KEY=VALUE")):
        with pytest.raises(SystemExit, match=said):
            bench._check_train_set(bench._parser().parse_args([*out, "--train-set", bad]), ["eagle1"])


def test_the_real_target_results_commands_parse() -> None:
    """The commands docs/results/smollm2/README.md gives parse with the script's and launcher's own
    parsers, with the values the figures were measured at."""
    import shlex

    from verl_speco.cpu_port.launch import build_parser

    text = (ROOT / "docs" / "results" / "smollm2" / "README.md").read_text()
    blocks = [b.split("```", 1)[0].replace("\\\n", " ").strip() for b in text.split("```bash\n")[1:]]
    bench_line = next(b for b in blocks if "bench_family_acceptance.py" in b)
    args = _bench_family_module()._parser().parse_args(shlex.split(bench_line)[2:])
    assert (args.target, args.k, args.steps, args.eval_sets, args.speed) == ("smollm2-135m", 3, 80, "sharegpt,humaneval", True)
    grpo_line = next(b for b in blocks if "run_cpu_grpo.sh" in b)
    launch = build_parser().parse_args(shlex.split(grpo_line)[2:])
    assert launch.target == "smollm2-135m" and "trainer.test_freq=1" in launch.overrides
