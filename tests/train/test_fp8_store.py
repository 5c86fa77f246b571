"""The trainer reads an fp8-encoded Feature Store (hidden states as e4m3 + a per-token scale) as it reads
a bf16 one: the same samples, the same run, losses within the encoding's error."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import overrides, write_store

from feature_store import load_store
from verl_speco.train.compose import load_config
from verl_speco.train.loop import run
from verl_speco.train.metrics_log import read_jsonl


@pytest.fixture(scope="module")
def fp8_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny store's 32 samples (same seed), hidden states fp8-encoded."""
    return write_store(tmp_path_factory.mktemp("fp8") / "store", 32, encoding="fp8_e4m3")


def _losses(target: Path, store: Path, out: Path) -> list[float]:
    summary = run(load_config(overrides(target, store, out, "run.total_steps=3", "run.eval_every=0",
                                        "run.save_every=3")))
    assert summary["step"] == 3 and summary["skipped_steps"] == 0
    return [r["loss"] for r in read_jsonl(out / "metrics.jsonl", "train")]


def test_training_from_an_fp8_store_tracks_the_bf16_store(tiny_target: Path, tiny_store: Path, fp8_store: Path,
                                                          tmp_path: Path) -> None:
    bf16, fp8 = load_store(tiny_store).schema, load_store(fp8_store).schema
    assert fp8.field("aux_hidden").encoding == "fp8_e4m3" and bf16.field("aux_hidden").encoding == "raw"
    ref = _losses(tiny_target, tiny_store, tmp_path / "bf16")
    got = _losses(tiny_target, fp8_store, tmp_path / "fp8")
    assert len(ref) == len(got) == 3
    # the features differ by <= 6.25% per element (about 2% typical): the losses moved by at most 0.1%
    # (0.04%, 0.02%, 0.10% measured; the run is deterministic, so that is the encoding's effect alone).
    # The 0.5% margin is 5x that; decoding with the scales dropped moved them by up to 1.0%.
    for step, (a, b) in enumerate(zip(ref, got)):
        assert abs(a - b) <= 0.005 * a, (step, a, b)
