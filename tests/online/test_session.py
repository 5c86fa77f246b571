"""The drafter side of online co-training: the versioned replay buffer, and `DrafterSession` on the
real tiny target (rows captured with `OnlineCapture` from real forwards, a real EAGLE-3 draft)."""

from __future__ import annotations

import dataclasses
import random
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from drafters.common.target import TargetHead
from drafters.eagle3.config import Eagle3Config
from drafters.eagle3.export import Eagle3ExportConfig, expected_shapes
from drafters.eagle3.family import FAMILY
from drafters.registry import engine_format_from_dict
from verl_speco.online.capture import CapturedRows, OnlineCapture
from verl_speco.online.config import CaptureCaps, DrafterRunConfig
from verl_speco.online.publish import load_version, read_manifest
from verl_speco.online.session import DrafterSession, FeatureBuffer, TargetHeadSnapshot
from verl_speco.online.session_link import SessionLink
from verl_speco.train.config import OptimConfig

LAYER_IDS = (2, 4, 5)


# --- FeatureBuffer -------------------------------------------------------------------------------------

def _rec(n: int, tag: int) -> dict[str, torch.Tensor]:
    """A row of n tokens; `tag` is written into input_ids so a test can tell rows apart."""
    return {"input_ids": torch.full((n,), tag, dtype=torch.int64), "loss_mask": torch.ones(n, dtype=torch.uint8),
            "aux_hidden": torch.zeros(n, 6), "last_hidden": torch.zeros(n, 2)}


def _rows(version: int, lengths: list[int], tag0: int = 0) -> CapturedRows:
    return CapturedRows([_rec(n, tag0 + i) for i, n in enumerate(lengths)], version, {"kept": len(lengths)})


def _head(version: int, seed: int | None = None) -> TargetHeadSnapshot:
    g = torch.Generator().manual_seed(version if seed is None else seed)
    return TargetHeadSnapshot(version, torch.randn(5, 2, generator=g), torch.randn(5, 2, generator=g))


def _tags(buf: FeatureBuffer) -> list[tuple[int, int]]:
    return [(e.version, int(e.record["input_ids"][0])) for e in buf.entries]


def test_head_of_another_version_is_refused() -> None:
    buf = FeatureBuffer(max_tokens=100, max_staleness=2)
    with pytest.raises(ValueError, match=r"head.version=2 but rows.policy_version=1"):
        buf.add(_rows(1, [3]), _head(2))
    assert not buf.entries and not buf.heads and buf.tokens == 0 and buf.latest_version == -1


def test_staleness_eviction() -> None:
    buf = FeatureBuffer(max_tokens=1000, max_staleness=1)
    buf.add(_rows(0, [3, 4], tag0=0), _head(0))
    buf.add(_rows(1, [5], tag0=10), _head(1))
    assert _tags(buf) == [(0, 0), (0, 1), (1, 10)] and buf.tokens == 12 and buf.evicted == 0
    assert sorted(buf.heads) == [0, 1] and buf.latest_version == 1
    buf.add(_rows(2, [2], tag0=20), _head(2))  # oldest kept version: 2 - 1 = 1
    assert _tags(buf) == [(1, 10), (2, 20)] and buf.tokens == 7 and buf.evicted == 2
    assert sorted(buf.heads) == [1, 2]
    buf.add(_rows(4, [1], tag0=40), _head(4))  # a jump: 1 and 2 are both older than 4 - 1
    assert _tags(buf) == [(4, 40)] and buf.tokens == 1 and buf.evicted == 4 and sorted(buf.heads) == [4]


def test_staleness_zero_keeps_only_the_latest_version() -> None:
    buf = FeatureBuffer(max_tokens=1000, max_staleness=0)
    buf.add(_rows(0, [3, 3]), _head(0))
    buf.add(_rows(1, [2], tag0=5), _head(1))
    assert _tags(buf) == [(1, 5)] and buf.evicted == 2 and sorted(buf.heads) == [1]


def test_token_capacity_evicts_oldest_first_and_drops_their_heads() -> None:
    buf = FeatureBuffer(max_tokens=10, max_staleness=100)
    buf.add(_rows(0, [4, 4], tag0=0), _head(0))
    assert buf.tokens == 8 and buf.evicted == 0
    buf.add(_rows(1, [6], tag0=10), _head(1))  # 14 > 10: the first row goes (10 <= 10)
    assert _tags(buf) == [(0, 1), (1, 10)] and buf.tokens == 10 and buf.evicted == 1
    assert sorted(buf.heads) == [0, 1]
    buf.add(_rows(2, [5], tag0=20), _head(2))  # 15 -> 11 -> 5: every older row goes
    assert _tags(buf) == [(2, 20)] and buf.tokens == 5 and buf.evicted == 3
    assert sorted(buf.heads) == [2]  # heads of versions without rows are dropped
    assert sum(int(e.record["input_ids"].numel()) for e in buf.entries) == buf.tokens


def test_a_single_oversized_row_is_kept() -> None:
    buf = FeatureBuffer(max_tokens=10, max_staleness=5)
    buf.add(_rows(0, [3]), _head(0))
    buf.add(_rows(1, [25], tag0=7), _head(1))
    assert _tags(buf) == [(1, 7)] and buf.tokens == 25 and buf.evicted == 1


def test_latest_head_kept_even_without_rows() -> None:
    buf = FeatureBuffer(max_tokens=10, max_staleness=5)
    buf.add(_rows(0, [3]), _head(0))
    buf.add(_rows(1, []), _head(1))
    assert buf.latest_version == 1 and sorted(buf.heads) == [0, 1] and buf.tokens == 3


def test_sample_draws_rows_of_one_version() -> None:
    buf = FeatureBuffer(max_tokens=1000, max_staleness=10)
    buf.add(_rows(0, [2, 2, 2], tag0=0), _head(0))
    buf.add(_rows(1, [3, 3, 3, 3, 3], tag0=100), _head(1))
    rng = random.Random(0)
    seen_versions = []
    for _ in range(200):
        version, rows, head = buf.sample(rng, 4)
        assert head.version == version
        tags = [int(r["input_ids"][0]) for r in rows]
        assert len(set(tags)) == len(tags)  # no row twice
        if version == 0:
            assert sorted(tags) == [0, 1, 2]  # n capped at the version's 3 rows
        else:
            assert len(tags) == 4 and all(100 <= t < 105 for t in tags)
        seen_versions.append(version)
    # versions drawn in proportion to their rows: 3/8 and 5/8
    frac0 = seen_versions.count(0) / len(seen_versions)
    assert 0.25 < frac0 < 0.5, frac0
    assert buf.sample(random.Random(3), 2)[:2] == buf.sample(random.Random(3), 2)[:2]  # seeded


def test_sample_from_empty_buffer_raises() -> None:
    with pytest.raises(RuntimeError, match="the buffer is empty"):
        FeatureBuffer(10, 1).sample(random.Random(0), 1)


# --- DrafterSession on the real target ---------------------------------------------------------------

def _capture(model: Any, version: int, prompt_len: int, resp_len: int, n: int = 6, seed: int = 0) -> CapturedRows:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, model.config.vocab_size, (n, prompt_len + resp_len), generator=g)
    am = torch.ones_like(ids)
    lm = torch.zeros_like(ids)
    lm[:, prompt_len:] = 1
    cap = OnlineCapture(LAYER_IDS, CaptureCaps(), seed=0, hidden_dtype=torch.float32)
    with torch.no_grad(), cap.hooks(model) as h:
        model(input_ids=ids, attention_mask=am)
        return cap.collect(h.pop_all(), ids, am, lm, version)


@pytest.fixture(scope="module")
def rows_v0(target_model) -> CapturedRows:  # type: ignore[no-untyped-def]
    return _capture(target_model, 0, 6, 10)


def _cfg(tmp: Path, **kw: Any) -> DrafterRunConfig:
    base: dict[str, Any] = {"enable": True, "settings": {"ttt_steps": 2}, "micro_batch_size": 8,
                            "train_steps_per_round": 2, "max_staleness": 5, "publish_dir": str(tmp / "pub"),
                            "optim": OptimConfig(lr=3e-3)}
    return DrafterRunConfig(**{**base, **kw}).validate()


def _objective(session: DrafterSession, records: list[dict[str, torch.Tensor]], head: TargetHeadSnapshot) -> float:
    session._use_head(head)
    batch = FAMILY.collate(records)
    with torch.no_grad():
        return float(FAMILY.objective(session.model, batch).loss())


def test_training_rounds_lower_the_objective(tmp_path: Path, target_dir: Path, target_model,  # type: ignore[no-untyped-def]
                                             rows_v0: CapturedRows) -> None:
    session = DrafterSession(_cfg(tmp_path), target_dir)
    assert session.fam_cfg.ttt_steps == 2 and session.fam_cfg.aux_layer_ids == LAYER_IDS
    head = TargetHeadSnapshot.from_model(target_model, 0)
    assert torch.equal(head.lm_head, target_model.lm_head.weight.detach())
    session.add(rows_v0, head)
    before = _objective(session, rows_v0.records, head)
    metrics = {}
    for _ in range(4):
        metrics = session.train_round(steps=5)
    after = _objective(session, rows_v0.records, head)
    assert after < 0.8 * before, (before, after)
    assert session.step == 20 and session.rounds == 4
    assert metrics["steps"] == 5.0 and metrics["skipped_steps"] == 0.0
    assert metrics["tokens"] == 5 * rows_v0.num_tokens  # every step sees all 6 rows (micro_batch_size 8)
    assert metrics["staleness_mean"] == 0.0 and metrics["staleness_max"] == 0.0
    assert metrics["buffer_tokens"] == rows_v0.num_tokens and metrics["buffer_evicted"] == 0.0
    assert "acc_step0" in metrics and "acc_step1" in metrics
    assert after < metrics["loss"] * 1.5  # the reported loss is the objective's own scale


def test_each_step_uses_the_head_of_the_sampled_version(tmp_path: Path, target_dir: Path,  # type: ignore[no-untyped-def]
                                                        target_model, rows_v0: CapturedRows) -> None:
    session = DrafterSession(_cfg(tmp_path, micro_batch_size=3), target_dir)
    rows_v1 = _capture(target_model, 1, 5, 12, n=4, seed=1)  # 17 tokens per row; v0 rows have 16
    h0 = TargetHeadSnapshot.from_model(target_model, 0)
    g = torch.Generator().manual_seed(9)
    h1 = TargetHeadSnapshot(1, torch.randn(h0.embed_tokens.shape, generator=g),
                            torch.randn(h0.lm_head.shape, generator=g))
    session.add(rows_v0, h0)
    session.add(rows_v1, h1)
    model: Any = session.model
    used: list[tuple[int, bool, bool]] = []

    def on_fc(_m: Any, args: tuple[torch.Tensor, ...]) -> None:  # fc(aux) runs once per objective
        version = {16: 0, 17: 1}[args[0].shape[1]]
        head = (h0, h1)[version]
        used.append((version, torch.equal(model.target_lm_head, head.lm_head),
                     torch.equal(model.embed_tokens.weight, head.embed_tokens)))

    handle = model.fc.register_forward_pre_hook(on_fc)
    try:
        metrics = session.train_round(steps=12)
    finally:
        handle.remove()
    assert len(used) == 12
    assert {v for v, _, _ in used} == {0, 1}  # both versions were drawn
    assert all(lm_ok and emb_ok for _, lm_ok, emb_ok in used), used
    lags = [1 - v for v, _, _ in used]
    assert metrics["staleness_mean"] == pytest.approx(sum(lags) / len(lags))
    assert metrics["staleness_max"] == 1.0
    # after the round the live model holds the latest version's head
    assert torch.equal(model.target_lm_head, h1.lm_head) and torch.equal(model.embed_tokens.weight, h1.embed_tokens)
    assert not model.embed_tokens.weight.requires_grad
    assert "target_lm_head" not in model.state_dict()


def test_engine_state_is_a_snapshot_with_the_export_shapes(tmp_path: Path, target_dir: Path,  # type: ignore[no-untyped-def]
                                                           target_model, rows_v0: CapturedRows) -> None:
    session = DrafterSession(_cfg(tmp_path), target_dir)
    session.add(rows_v0, TargetHeadSnapshot.from_model(target_model, 0))
    state = session.engine_state()
    spec = TargetHead.from_pretrained(target_dir).spec
    want = expected_shapes(Eagle3ExportConfig.from_drafter(Eagle3Config(), spec))
    assert {k: tuple(v.shape) for k, v in state.items()} == want
    assert "embed_tokens.weight" not in state and "d2t" not in state  # full vocab: no maps
    assert all(v.device.type == "cpu" and v.dtype == torch.float32 for v in state.values())
    frozen = {k: v.clone() for k, v in state.items()}
    live = dict(session.model.named_parameters())
    assert all(v.untyped_storage().data_ptr() != live[k].untyped_storage().data_ptr()
               for k, v in state.items() if k in live)
    session.train_round(steps=2)
    assert all(torch.equal(state[k], frozen[k]) for k in state)  # training did not touch the snapshot
    new = session.engine_state()
    assert not torch.equal(new["fc.weight"], state["fc.weight"])  # while the draft itself did change
    assert torch.equal(new["fc.weight"], session.model.fc.weight.detach())  # type: ignore[union-attr]


def test_publish_writes_increasing_versions_equal_to_engine_state(tmp_path: Path, target_dir: Path,  # type: ignore[no-untyped-def]
                                                                  target_model, rows_v0: CapturedRows) -> None:
    session = DrafterSession(_cfg(tmp_path), target_dir)
    session.add(rows_v0, TargetHeadSnapshot.from_model(target_model, 0))
    states, pubs = [], []
    for _ in range(3):
        session.train_round(steps=1)
        states.append(session.engine_state())
        pubs.append(session.publish())
    assert [p.version for p in pubs] == [1, 2, 3]
    assert all(p.path.parent == tmp_path / "pub" for p in pubs)
    assert sorted(p.name for p in (tmp_path / "pub").iterdir()) == ["v000002", "v000003"]  # keep=2
    for pub, state in zip(pubs[1:], states[1:]):
        got = load_version(pub.path, pub.version)
        assert list(got) == list(state)
        for name, t in got.items():
            assert t.dtype == state[name].dtype
            assert torch.equal(t.view(torch.int32), state[name].view(torch.int32)), name
        meta = read_manifest(pub.path)["meta"]
        assert {k: meta[k] for k in ("optimizer_step", "policy_version")} == {"optimizer_step": pub.version,
                                                                             "policy_version": 0}
        assert engine_format_from_dict(meta["engine_format"]) == Eagle3ExportConfig.from_drafter(
            session.fam_cfg, session.target_spec)  # what an SGLang server builds its update with
    assert not torch.equal(states[1]["fc.weight"], states[2]["fc.weight"])
    other = session.publish(tmp_path / "elsewhere")
    assert other.version == 4 and other.path == tmp_path / "elsewhere" / "v000004"


def _export(tmp_path: Path, target_dir: Path) -> tuple[Path, dict[str, torch.Tensor]]:
    target = TargetHead.from_pretrained(target_dir)
    cfg = Eagle3Config(ttt_steps=3).resolve(target.spec)
    torch.manual_seed(123)
    model = FAMILY.build(cfg, target, None)
    out = FAMILY.export(model, cfg, target.spec, tmp_path / "export", "native")
    return out, load_file(str(out / "model.safetensors"))


def test_loading_from_an_export(tmp_path: Path, target_dir: Path, target_model,  # type: ignore[no-untyped-def]
                                rows_v0: CapturedRows) -> None:
    export_dir, exported = _export(tmp_path, target_dir)
    session = DrafterSession(_cfg(tmp_path, model_path=str(export_dir), settings={"ttt_steps": 2, "ttt_decay": 0.5}),
                             target_dir)
    assert session.fam_cfg.ttt_steps == 2 and session.fam_cfg.ttt_decay == 0.5
    assert session.model.training  # type: ignore[union-attr]
    state = session.engine_state()
    assert set(state) == set(exported)
    assert all(torch.equal(state[k], exported[k]) for k in exported)  # the export's weights, bit-exact
    session.add(rows_v0, TargetHeadSnapshot.from_model(target_model, 0))
    session.train_round(steps=1)
    assert not torch.equal(session.engine_state()["fc.weight"], exported["fc.weight"])


@pytest.mark.parametrize(("k", "settings", "loaded", "ttt"), [
    (3, {}, True, 3), (5, {}, False, 5), (1, {"ttt_decay": 0.5}, True, 1),  # unset: the depth the rollout drafts
    (3, {"ttt_steps": 7}, True, 7), (4, {"ttt_steps": 2}, False, 2)])  # set: kept as given
def test_unroll_depth_defaults_to_the_served_depth(tmp_path: Path, target_dir: Path, k: int, settings: dict[str, Any],
                                                   loaded: bool, ttt: int) -> None:
    export_dir, _ = _export(tmp_path, target_dir)  # its config would give the offline default, 7
    assert Eagle3Config().ttt_steps == 7
    cfg = _cfg(tmp_path, num_speculative_tokens=k, settings=settings, model_path=str(export_dir) if loaded else None)
    session = DrafterSession(cfg, target_dir)
    assert session.fam_cfg.ttt_steps == ttt
    assert cfg.settings == settings  # the run's config is not rewritten


@pytest.mark.parametrize("settings", [{"num_layers": 2}, {"ttt_steps": 2, "draft_vocab_size": 100},
                                      {"aux_layer_ids": [1, 3, 5]}, {"lm_head_init": "target"}])
def test_architecture_settings_rejected_with_model_path(tmp_path: Path, target_dir: Path,
                                                        settings: dict[str, Any]) -> None:
    export_dir, _ = _export(tmp_path, target_dir)
    bad = sorted(set(settings) - {"ttt_steps"})
    with pytest.raises(ValueError, match=r"drafter\.settings: " + repr(bad).replace("[", r"\[").replace("]", r"\]")):
        DrafterSession(_cfg(tmp_path, model_path=str(export_dir), settings=settings), target_dir)


def test_warmup_lr_schedule(tmp_path: Path, target_dir: Path, target_model,  # type: ignore[no-untyped-def]
                            rows_v0: CapturedRows) -> None:
    cfg = _cfg(tmp_path, optim=OptimConfig(lr=1e-3, warmup_steps=4))
    session = DrafterSession(cfg, target_dir)
    session.add(rows_v0, TargetHeadSnapshot.from_model(target_model, 0))
    lrs = []
    for _ in range(5):
        session.train_round(steps=1)
        lrs.append(session.optimizer.param_groups[0]["lr"])
    assert lrs == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3])
    assert dataclasses.replace(cfg).optim.lr == 1e-3


def test_round_in_flight_survives_a_newer_version_evicting_its_rows(tmp_path: Path, target_dir: Path,  # type: ignore[no-untyped-def]
                                                                    target_model, rows_v0: CapturedRows) -> None:
    """Overlap schedule: `add()` may run while a round trains (FeatureBuffer.lock). A newer version
    that evicts the rows (and so the head) of the version the round started on must not crash it."""
    session = DrafterSession(_cfg(tmp_path, max_staleness=0, schedule="overlap", train_steps_per_round=40),
                             target_dir)
    session.add(rows_v0, TargetHeadSnapshot.from_model(target_model, 0))
    rows_v1 = _capture(target_model, 1, 6, 10, n=4, seed=1)
    link = SessionLink(session)
    handle = link.start_round()
    deadline = time.monotonic() + 60
    while session.step < 1 and time.monotonic() < deadline:  # the round has read latest_version = 0
        time.sleep(0.001)
    session.add(rows_v1, TargetHeadSnapshot.from_model(target_model, 1))  # evicts every v0 row and its head
    assert session.step < 40, "the round finished before the add: the test did not exercise the overlap"
    try:
        metrics = link.wait_round(handle)
    finally:
        link.close()
    assert metrics["steps"] == 40.0


def test_round_length_follows_the_rows_captured_since_the_previous_round(  # type: ignore[no-untyped-def]
        tmp_path: Path, target_dir: Path, target_model, rows_v0: CapturedRows) -> None:
    """train_steps_per_round=None: ceil(passes x new rows / micro_batch_size), counted by hand below;
    the rows are consumed by the round (also by one started in the background), a fixed count wins."""
    session = DrafterSession(_cfg(tmp_path, train_steps_per_round=None, train_passes_per_round=4.0,
                                  micro_batch_size=8), target_dir)
    assert session.next_round_steps() == 0  # nothing buffered yet
    head0 = TargetHeadSnapshot.from_model(target_model, 0)
    session.add(rows_v0, head0)  # 6 rows: ceil(4 * 6 / 8) = 3
    assert session.next_round_steps() == 3
    rows_v1 = _capture(target_model, 1, 6, 10, n=5, seed=1)
    session.add(rows_v1, TargetHeadSnapshot.from_model(target_model, 1))  # 6 + 5 = 11 rows: ceil(44 / 8) = 6
    assert session.next_round_steps() == 6
    metrics = session.train_round()
    assert metrics["steps"] == 6.0 and session.step == 6
    assert session.next_round_steps() == 0  # no new rows: nothing left to learn from
    assert session.train_round()["steps"] == 0.0 and session.step == 6
    session.add(_capture(target_model, 2, 6, 10, n=2, seed=2), TargetHeadSnapshot.from_model(target_model, 2))
    session.cfg = dataclasses.replace(session.cfg, train_passes_per_round=2.5)  # ceil(2.5 * 2 / 8) = 1
    assert session.next_round_steps() == 1
    link = SessionLink(session)  # a round in the background (the overlap schedule's) consumes them at its start
    handle = link.start_round()
    assert session.next_round_steps() == 0
    try:
        background = link.wait_round(handle)
    finally:
        link.close()
    assert background["steps"] == 1.0 and session.next_round_steps() == 0
    fixed = DrafterSession(_cfg(tmp_path, train_steps_per_round=7), target_dir)
    assert fixed.next_round_steps() == 0
    fixed.add(rows_v0, head0)
    fixed.train_round(steps=1)
    assert fixed.next_round_steps() == 7  # a fixed count does not depend on new rows
