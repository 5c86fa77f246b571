"""The overlap schedule: a round run in the background equals the same round run in line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from verl_speco.online.capture import CapturedRows, OnlineCapture
from verl_speco.online.config import CaptureCaps, DrafterRunConfig
from verl_speco.online.session import DrafterSession, TargetHeadSnapshot
from verl_speco.train.config import OptimConfig

LAYER_IDS = (2, 4, 5)


def _rows(model: Any, version: int) -> CapturedRows:
    g = torch.Generator().manual_seed(version)
    ids = torch.randint(3, model.config.vocab_size, (4, 14), generator=g)
    am, lm = torch.ones_like(ids), torch.zeros_like(ids)
    lm[:, 5:] = 1
    cap = OnlineCapture(LAYER_IDS, CaptureCaps(), seed=0, hidden_dtype=torch.float32)
    with torch.no_grad(), cap.hooks(model) as h:
        model(input_ids=ids, attention_mask=am)
        return cap.collect(h.pop_all(), ids, am, lm, version)


def _session(tmp: Path, target_dir: Path, model: Any) -> DrafterSession:
    cfg = DrafterRunConfig(enable=True, settings={"ttt_steps": 2}, micro_batch_size=4, train_steps_per_round=3,
                           max_staleness=3, publish_dir=str(tmp / "pub"), schedule="overlap",
                           optim=OptimConfig(lr=3e-3)).validate()
    session = DrafterSession(cfg, target_dir)
    session.add(_rows(model, 0), TargetHeadSnapshot.from_model(model, 0))
    return session


def test_background_round_equals_inline_round(tmp_path: Path, target_dir: Path, target_model: Any) -> None:
    inline = _session(tmp_path / "a", target_dir, target_model)
    overlap = _session(tmp_path / "b", target_dir, target_model)
    assert all(torch.equal(a, b) for a, b in zip(inline.engine_state().values(), overlap.engine_state().values()))
    want = inline.train_round()
    overlap.start_round()
    with pytest.raises(RuntimeError, match="in flight"):
        overlap.engine_state()  # never snapshot weights that are being trained
    with pytest.raises(RuntimeError, match="already in flight"):
        overlap.start_round()
    got = overlap.finish_round()
    assert got is not None and overlap.finish_round() is None
    assert {k: v for k, v in got.items() if k != "train_seconds"} == \
        {k: v for k, v in want.items() if k != "train_seconds"}
    a, b = inline.engine_state(), overlap.engine_state()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    overlap.close()


def test_rows_added_during_a_round_are_kept(tmp_path: Path, target_dir: Path, target_model: Any) -> None:
    session = _session(tmp_path, target_dir, target_model)
    session.start_round()
    session.add(_rows(target_model, 1), TargetHeadSnapshot.from_model(target_model, 1))  # while training
    session.finish_round()
    assert sorted({e.version for e in session.buffer.entries}) == [0, 1]
    metrics = session.train_round()
    assert metrics["steps"] == 3.0 and metrics["skipped_steps"] == 0.0
    session.close()


def test_rows_and_heads_cross_processes_as_safetensors_bytes(target_model: Any) -> None:
    rows = _rows(target_model, 3)
    data = rows.to_bytes()
    assert isinstance(data, bytes) and data[8:9] == b"{"  # a safetensors header, no pickle
    back = CapturedRows.from_bytes(data)
    assert back.policy_version == 3 and back.counts == rows.counts and len(back.records) == len(rows.records)
    for a, b in zip(rows.records, back.records):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)
    head = TargetHeadSnapshot.from_model(target_model, 3)
    head_back = TargetHeadSnapshot.from_bytes(head.to_bytes())
    assert head_back.version == 3
    assert torch.equal(head_back.lm_head, head.lm_head) and torch.equal(head_back.embed_tokens, head.embed_tokens)
