"""scripts/drift_seeds.py on hand-made metrics.jsonl files: each run's goal window, each group's met count,
one-step-short count and Wilson interval, the printed table, the chart, and a bad --run refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from file_modules import load_script


def _run(tmp: Path, name: str, gains: dict[int, float], nested: bool = False) -> Path:
    """A paired run whose initial draft makes 2.0 at every step and whose served draft makes 2.0 x gain."""
    folder = tmp / name / "results" if nested else tmp / name
    folder.mkdir(parents=True)
    rows = [{"arm": "cotrained", "step": s, "heldout_acceptance": 2.0 * g, "heldout_baseline_acceptance": 2.0}
            for s, g in gains.items()]
    rows.append({"arm": "frozen", "step": 4, "heldout_acceptance": 1.0, "heldout_baseline_acceptance": 2.0})
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def test_groups_count_met_and_one_step_short_runs(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    seeds = load_script("drift_seeds")
    met = _run(tmp_path, "met", {3: 1.0, 4: 1.3, 5: 1.5}, nested=True)  # step 3 is before the window
    short = _run(tmp_path, "short", {4: 1.4, 5: 1.29})
    far = _run(tmp_path, "far", {4: 1.0, 5: 1.1})
    out = seeds.main(["--run", f"a={met}", "--run", f"a={short / 'metrics.jsonl'}", "--run", f"b={far}",
                      "--json", str(tmp_path / "s.json"), "--png", str(tmp_path / "s.png")])
    runs = {r["run"]: r for r in out["runs"]}
    assert list(runs) == ["met", "short", "far"]  # `met/results/metrics.jsonl` is named by the run's folder
    assert runs["met"]["met"] and runs["met"]["steps"] == [4, 5] and runs["met"]["curve_steps"] == [3, 4, 5]
    assert runs["short"]["at_or_above"] == 1 and not runs["short"]["met"]
    assert runs["far"]["margin_mean"] == pytest.approx(0.1)  # 2.0 x (0.0 + 0.1) / 2
    a, b = out["groups"]["a"], out["groups"]["b"]
    assert (a["runs"], a["met"], a["one_step_short"]) == (2, 1, 1)
    assert (b["runs"], b["met"], b["one_step_short"]) == (1, 0, 0)  # 0 of 2 steps: two short, not one
    assert (a["met_rate_low"], a["met_rate_high"]) == (pytest.approx(0.0945, abs=1e-4), pytest.approx(0.9055, abs=1e-4))
    lines = capsys.readouterr().out.splitlines()
    # margins 0.6 and 1.0: mean 0.8, sample sd sqrt(0.2^2 + 0.2^2) = 0.28
    assert lines[1].split() == ["a", "met", "0.80", "(0.28)", "1.300", "/", "1.400", "2", "of", "2", "met"]
    assert lines[-2] == "a: met in 1 of 2 runs (95% Wilson interval 0.09 to 0.91), one step short in 1"
    assert json.loads((tmp_path / "s.json").read_text())["groups"]["b"]["met"] == 0
    assert (tmp_path / "s.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_bad_run_is_refused_by_name(tmp_path: Path) -> None:
    seeds = load_script("drift_seeds")
    with pytest.raises(ValueError, match=r"--run 'nolabel': expected LABEL=PATH"):
        seeds.main(["--run", "nolabel"])
    with pytest.raises(ValueError, match=r"--run 'a=.*missing': .*missing is not a file; expected a metrics\.jsonl"):
        seeds.main(["--run", f"a={tmp_path / 'missing'}"])
    early = _run(tmp_path, "early", {1: 1.5, 2: 1.5})
    with pytest.raises(ValueError, match=r"--run 'a=.*early': goal_window: no paired validation step >= 4 in .*"):
        seeds.main(["--run", f"a={early}"])


def test_reachable_prints_each_missed_step_with_its_ceiling(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    seeds = load_script("drift_seeds")
    met = _run(tmp_path, "met", {4: 1.3, 5: 1.5}, nested=True)  # reachable.json above results/
    short = _run(tmp_path, "short", {4: 1.4, 5: 1.29, 6: 1.1})  # reachable.json beside metrics.jsonl
    (tmp_path / "met" / "reachable.json").write_text(json.dumps(
        {"4": {"reachable_gain": 1.6, "gain": 1.3}, "5": {"reachable_gain": 1.9, "gain": 1.5}}))
    (short / "reachable.json").write_text(json.dumps(
        {"4": {"reachable_gain": 1.7}, "5": {"reachable_gain": 1.55}, "6": {"reachable_gain": 1.8}}))
    out = seeds.main(["--run", f"a={met}", "--run", f"a={short}", "--reachable"])
    assert out["runs"][1]["reachability"]["missed"] == [(5, pytest.approx(1.29), 1.55), (6, pytest.approx(1.1), 1.8)]
    lines = capsys.readouterr().out.splitlines()
    assert lines[-2] == "short missed: step 5 1.290 (reachable 1.550), step 6 1.100 (reachable 1.800)"
    # met steps' ceilings 1.6, 1.9, 1.7: the lowest 1.6; of the missed (1.55, 1.8) one is below it
    assert lines[-1] == ("every step that met the goal had a reachable gain of 1.600 or more; "
                         "1 of the 2 missed steps had less")
    (short / "reachable.json").write_text(json.dumps({"4": {"gain": 1.4}}))
    with pytest.raises(ValueError, match=r"short/reachable.json: expected \{step: \{'reachable_gain'"):
        seeds.main(["--run", f"a={short}", "--reachable"])
    (short / "reachable.json").unlink()
    with pytest.raises(ValueError, match=r"--reachable: no reachable.json beside .*short/metrics.jsonl"):
        seeds.main(["--run", f"a={short}", "--reachable"])


def test_a_partial_run_is_printed_and_left_out_of_its_group(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    seeds = load_script("drift_seeds")
    done = _run(tmp_path, "done", {4: 1.3, 5: 1.5, 6: 1.4})
    stopped = _run(tmp_path, "stopped", {4: 1.6, 5: 1.7})  # every step it reached met the goal
    (done / "summary.json").write_text(json.dumps({"steps": 6}))
    (stopped / "summary.json").write_text(json.dumps({"steps": 6}))
    out = seeds.main(["--run", f"a={done}", "--run", f"a={stopped}"])
    runs = {r["run"]: r for r in out["runs"]}
    assert not runs["done"]["partial"] and runs["stopped"]["partial"] and runs["stopped"]["met"]
    assert (out["groups"]["a"]["runs"], out["groups"]["a"]["met"]) == (1, 1)  # the partial one is not counted
    lines = capsys.readouterr().out.splitlines()
    assert lines[2].endswith("2 of 2  partial: stopped at step 5 of 6")
    assert lines[-1].startswith("a: met in 1 of 1 runs")
    (stopped / "summary.json").write_text(json.dumps({"steps": "six"}))
    with pytest.raises(ValueError, match=r"stopped/summary.json: 'steps' is 'six', expected an integer"):
        seeds.main(["--run", f"a={stopped}"])
    (stopped / "summary.json").write_text("[]")
    with pytest.raises(ValueError, match=r"stopped/summary.json: expected a JSON object with an integer 'steps'"):
        seeds.main(["--run", f"a={stopped}"])
