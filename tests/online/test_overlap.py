"""The overlap schedule with an in-process drafter: a round the controller runs in the background
(`SessionLink`) equals the same round run in line."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from verl_speco.online.capture import CapturedRows, OnlineCapture
from verl_speco.online.config import CaptureCaps, DrafterRunConfig
from verl_speco.online.controller import OnlineController
from verl_speco.online.session import DrafterSession, TargetHeadSnapshot
from verl_speco.online.session_link import SessionLink
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
    link = SessionLink(overlap)
    ctl = OnlineController(overlap.cfg, link)
    assert ctl.maybe_train(step=1, last=False) == {} and ctl.in_flight  # started, not collected
    with pytest.raises(RuntimeError, match="in flight"):
        link.publish()  # never publish weights that are being trained
    with pytest.raises(RuntimeError, match="already in flight"):
        link.start_round()
    got = ctl.collect()
    assert ctl.collect() == {} and not ctl.in_flight and ctl.rounds == 1
    assert ctl.last_round is not None
    assert {k: v for k, v in ctl.last_round.items() if k != "train_seconds"} == \
        {k: v for k, v in want.items() if k != "train_seconds"}
    assert got["drafter/steps"] == 3.0 and got["drafter/version"] == 1.0  # publish_interval=1: published
    assert ctl.latest is not None and (Path(ctl.latest["path"]) / "manifest.json").is_file()
    a, b = inline.engine_state(), overlap.engine_state()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    link.close()


def test_rows_added_during_a_round_are_kept(tmp_path: Path, target_dir: Path, target_model: Any) -> None:
    session = _session(tmp_path, target_dir, target_model)
    link = SessionLink(session)
    ctl = OnlineController(session.cfg, link)
    ctl.maybe_train(step=1, last=False)
    ctl.add([_rows(target_model, 1)], TargetHeadSnapshot.from_model(target_model, 1))  # while training
    ctl.collect(publish=False)
    assert sorted({e.version for e in session.buffer.entries}) == [0, 1]
    metrics = session.train_round()
    assert metrics["steps"] == 3.0 and metrics["skipped_steps"] == 0.0
    link.close()


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
