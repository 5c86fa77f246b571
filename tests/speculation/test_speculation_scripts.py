"""The speculation scripts' own logic on made-up measurements: the benchmark's comparison and table
(scripts/bench_speculation_schedule.py) and the GPU projection end to end (scripts/project_speculation_gpu.py),
including its reading of the device check's hardware row."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from file_modules import load_script

from verl_speco.speculation.cost_model import StepTimes
from verl_speco.speculation.plan import Calibration, SpeculationPlan

TIMES = StepTimes((1, 4), (0.010, 0.016), ((0.011, 0.018), (0.014, 0.030)), (0.04, 0.07), (0.05, 0.08))


def test_bench_compare_auto_picks_per_workload_and_flags_shortfalls_beyond_noise() -> None:
    bench = load_script("bench_speculation_schedule")
    cal = Calibration(TIMES, (0.8,), max_num_seqs=4)
    plan = SpeculationPlan([(1, 1, 1), (2, 4, 0)], speculate=True, k_max=1)
    work = {"b=1": [([1, 2], 20)], "b=4": [([1], 5)] * 4}
    same = {"b=1": [[7, 7, 7, 7, 7]], "b=4": [[1, 1, 1, 1, 1]] * 4}

    def arm(walls: dict[str, list[float]], outputs: dict[str, list[list[int]]] = same) -> dict:
        return {w: {"wall_s": walls[w], "tokens": sum(n for _, n in work[w]), "outputs": outputs[w]} for w in work}

    measured = {"plain": arm({"b=1": [0.2, 0.1], "b=4": [0.20, 0.21]}),
                "k=1": arm({"b=1": [0.08, 0.09], "b=4": [0.30, 0.25]}),
                "schedule": arm({"b=1": [0.08, 0.1], "b=4": [0.22, 0.23]},
                                {"b=1": [[7, 7, 7, 7, 8]], "b=4": same["b=4"]})}
    report = bench._compare(cal, plan, measured, work, [1])
    b1 = report["points"]["schedule"]["b=1"]
    assert b1["measured_tokens_per_s"] == pytest.approx(20 / 0.08) and b1["noise"] == pytest.approx(0.25)
    assert not b1["lossless"] and not report["all_lossless"]  # a planted wrong token
    # b=1, 20 tokens: drafting 0.05 s prefill + 11 steps of 14 ms (1.8 tokens each) = 0.204 s against plain's
    # 0.04 + 19 x 10 ms = 0.23 s -> auto drafts; b=4, 5 tokens each: the draft's prefill and k=0 steps cost more
    # than k=1 saves -> auto is plain
    assert report["verdict"]["b=1"] == {"auto": "schedule", "best_other": "k=1", "auto_vs_best": pytest.approx(1.0),
                                        "auto_vs_plain": pytest.approx(0.1 / 0.08), "slower_beyond_noise": False}
    assert report["verdict"]["b=4"]["auto"] == "plain" and report["points"]["auto"]["b=4"]["chosen"] == "plain"
    assert report["points"]["plain"]["b=1"]["predicted_tokens_per_s"] == pytest.approx(20 / 0.23)
    assert report["points"]["schedule"]["b=1"]["predicted_tokens_per_s"] == pytest.approx(20 / 0.204)
    table = bench._table(report)
    assert "| b=4 |" in table and "every arm lossless: False" in table
    # a shortfall larger than both points' spread is flagged
    measured["schedule"]["b=1"]["wall_s"] = [0.2, 0.2]
    assert bench._compare(cal, plan, measured, work, [1])["verdict"]["b=1"]["slower_beyond_noise"]


def test_gpu_projection_end_to_end(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    project = load_script("project_speculation_gpu")
    check = {"rows": [{"unit": "speculation_roofline", "hardware": {"name": "gpu (measured)",
                                                                   "bytes_per_s": 2.6e12, "flops": 6e14}}]}
    (tmp_path / "gpu_check.json").write_text(json.dumps(check))
    assert project.main(["--acceptance", "eagle3=0.8,0.6,0.4", "--acceptance", "dflash=0.3,0.1",
                         "--hardware", "h100", "--hardware", str(tmp_path / "gpu_check.json"),
                         "--rollout", "64,256,0.8,1024", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "gpu_projection.json").read_text())["rows"]
    assert [(r["hardware"], r["family"]) for r in rows] == [
        ("H100 SXM (paper)", "eagle3"), ("H100 SXM (paper)", "dflash"), ("gpu (measured)", "eagle3"),
        ("gpu (measured)", "dflash")]
    for r in rows:  # the schedule is never predicted slower than plain, nor than any fixed k by more than 5%
        assert r["speedup_vs_plain"]["schedule"] >= 1.0
        assert r["speedup_vs_plain"]["schedule"] >= 0.95 * max(v for a, v in r["speedup_vs_plain"].items()
                                                               if a.startswith("k="))
    assert "| H100 SXM (paper) | eagle3 |" in capsys.readouterr().out
    (tmp_path / "nothing.json").write_text("{}")
    with pytest.raises(SystemExit, match="holds no mapping with name, bytes_per_s and flops"):
        project.main(["--acceptance", "eagle3=0.5", "--hardware", str(tmp_path / "nothing.json"),
                      "--out", str(tmp_path)])
