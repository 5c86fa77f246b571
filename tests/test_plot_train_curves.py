"""`scripts/plot_train_curves.py`: held-out records read from real metrics logs, the table's figures,
the PNG, and one clear refusal per kind of bad input."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from file_modules import load_script

from verl_speco.train.metrics_log import MetricsLogger

plot_curves = load_script("plot_train_curves")


def _run_log(out_dir: Path, evals: dict[int, tuple[float, float]]) -> Path:
    """A metrics.jsonl written by the trainer's own logger: a train record every step, an eval record
    (acc_step0, loss) at the steps given."""
    logger = MetricsLogger(out_dir, enabled=True, start_step=0, total_steps=max(evals),
                           tensorboard=False, progress_bar=False)
    for step in range(1, max(evals) + 1):
        logger.log(step, "train", {"loss": 0.01, "acc_step0": 0.99})
        if step in evals:
            acc, loss = evals[step]
            logger.log(step, "eval", {"acc_step0": acc, "loss": loss})
    logger.close()
    return out_dir / "metrics.jsonl"


def test_table_reads_only_held_out_records_and_the_chart_is_written(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    a = _run_log(tmp_path / "a", {50: (0.20, 1.30), 100: (0.35, 1.10), 150: (0.30, 1.05)})
    b = _run_log(tmp_path / "b", {50: (0.25, 1.20), 100: (0.28, 1.15)})
    out = tmp_path / "charts" / "curves.png"
    assert plot_curves.main(["--run", f"lr=1e-3={a}", "--run", f"short={b}", "--out", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    # Last held-out record and best first metric, by hand; the train records (acc 0.99, loss 0.01) never show.
    assert "| lr=1e-3 | 150 | 0.3000 | 1.0500 | 0.3500 (100) |" in lines
    assert "| short | 100 | 0.2800 | 1.1500 | 0.2800 (100) |" in lines
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and not list(out.parent.glob("*.tmp.png"))
    # A loss first: the best is the lowest.
    plot_curves.main(["--run", f"a={a}", "--metrics", "loss", "--out", str(out)])
    assert "| a | 150 | 1.0500 | 1.0500 (150) |" in capsys.readouterr().out


def test_bad_input_is_refused_by_name(tmp_path: Path) -> None:
    good = _run_log(tmp_path / "good", {10: (0.1, 2.0)})
    train_only = tmp_path / "train_only.jsonl"
    train_only.write_text(json.dumps({"step": 1, "kind": "train", "loss": 1.0}) + "\n")
    torn_middle = tmp_path / "torn.jsonl"
    torn_middle.write_text('{"step": 1, "kind": "eval", "acc_step0": 0.1, "loss": 1}\n{"step": 2,\n'
                           '{"step": 3, "kind": "eval", "acc_step0": 0.2, "loss": 1}\n')
    out = str(tmp_path / "c.png")
    cases = [
        (["--run", str(good)], "expected LABEL=PATH"),
        (["--run", f"x={tmp_path / 'missing.jsonl'}"], "no such file"),
        (["--run", f"x={train_only}"], "no eval records"),
        (["--run", f"x={good}", "--run", f"x={good}"], "repeat one"),
        (["--run", f"x={good}", "--metrics", "vloss"], r"step 10 has no \['vloss'\]"),
        (["--run", f"x={torn_middle}"], "torn.jsonl:2: not a JSON record"),
        (["--run", f"x={good}", "--metrics", " , "], "expected at least one metric"),
    ]
    for argv, said in cases:
        with pytest.raises(SystemExit, match=said):
            plot_curves.main([*argv, "--out", out])
    assert not Path(out).exists()
