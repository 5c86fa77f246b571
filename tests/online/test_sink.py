"""`collect_only`: captured rows of the real target go to a real Feature Store and read back bit-exactly."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from feature_store import Layout, StoreIndex, StoreReader, load_store
from feature_store.inspect import main as inspect_main
from verl_speco.online.capture import CapturedRows, OnlineCapture
from verl_speco.online.config import CaptureCaps, FeatureStoreSink
from verl_speco.online.sink import StoreSink

LAYER_IDS = (2, 4, 5)


def _capture(model: Any, version: int, seed: int, n: int) -> CapturedRows:
    """n rows of [left-padded prompt | right-padded response], float32 activations."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, model.config.vocab_size, (n, 14), generator=g)
    am = torch.zeros_like(ids)
    lm = torch.zeros_like(ids)
    for b in range(n):
        p, r = 3 + b % 4, 2 + (b * 3) % 6  # prompt in [6 - p, 6), response in [6, 6 + r)
        am[b, 6 - p: 6 + r] = 1
        lm[b, 6: 6 + r] = 1
    cap = OnlineCapture(LAYER_IDS, CaptureCaps(), seed=seed, hidden_dtype=torch.float32)
    with torch.no_grad(), cap.hooks(model) as h:
        model(input_ids=ids, attention_mask=am)
        rows = cap.collect(h.pop_all(), ids, am, lm, version)
    assert len(rows.records) == n
    return rows


def _bits(t: torch.Tensor) -> torch.Tensor:
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.contiguous().view(ints) if t.is_floating_point() else t


@pytest.mark.parametrize("hidden_dtype", ["bfloat16", "float32", "float16"])
def test_store_sink_round_trip(tmp_path: Path, target_model, hidden_dtype: str) -> None:  # type: ignore[no-untyped-def]
    root = tmp_path / "store"
    cfg = FeatureStoreSink(path=str(root), hidden_dtype=hidden_dtype, flush_samples=3)
    vocab = target_model.config.vocab_size
    sink = StoreSink(cfg, LAYER_IDS, hidden_size=128, vocab_size=vocab, target_model_id="tiny-qwen3", rank=0,
                     producer={"run": "t"})
    steps = [(10, _capture(target_model, 4, seed=1, n=5)), (11, _capture(target_model, 5, seed=2, n=4))]
    expected = []
    for step, rows in steps:
        sink.write(rows, step)
        sink.end_step(step)
        expected += [(step, rows.policy_version, r) for r in rows.records]
    sink.close()
    assert sink.samples == 9 and sink.tokens == sum(int(r["input_ids"].numel()) for _, _, r in expected)

    meta = load_store(root)
    assert meta.producer["tool"] == "verl-speco online collect_only" and meta.producer["run"] == "t"
    schema = meta.schema
    assert schema.layout.layer_ids == LAYER_IDS and schema.layout.last_hidden == "post_norm"
    assert schema.layout.check_matches(Layout(layer_ids=LAYER_IDS, last_hidden="post_norm")) is None
    assert schema.hidden_size == 128 and schema.vocab_size == vocab and schema.target_model_id == "tiny-qwen3"
    dtype = getattr(torch, hidden_dtype)
    assert schema.field("aux_hidden").torch_dtype == dtype and schema.field("last_hidden").torch_dtype == dtype

    index = StoreIndex.open(root, verify_checksums=True)
    assert index.num_samples == 9 and index.num_tokens == sink.tokens
    assert len(index.commits) >= 4  # flush_samples=3 plus a commit at every step boundary
    for g, (step, version, rec) in enumerate(expected):  # one writer: storage order is write order
        got = index.sample(g, copy=True)
        assert int(got["global_step"]) == step and int(got["policy_version"]) == version
        assert torch.equal(got["input_ids"], rec["input_ids"]) and got["input_ids"].dtype == torch.int64
        assert torch.equal(got["loss_mask"], rec["loss_mask"]) and got["loss_mask"].dtype == torch.uint8
        for k in ("aux_hidden", "last_hidden"):
            assert got[k].dtype == dtype and got[k].shape == rec[k].shape
            assert torch.equal(_bits(got[k]), _bits(rec[k].to(dtype))), (g, k)
    index.close()

    with StoreReader(root, shuffle=False, prefetch=0, expect_layout=Layout(layer_ids=LAYER_IDS,
                                                                           last_hidden="post_norm")) as reader:
        assert len(reader) == 9
        it = reader.iter_samples()
        for _, _, rec in expected:  # compared while the shards are mapped (the reader returns views)
            assert torch.equal(next(it)["input_ids"], rec["input_ids"])


def test_inspect_cli_is_clean_on_a_sink_store(tmp_path: Path, target_model, capsys) -> None:  # type: ignore[no-untyped-def]
    root = tmp_path / "store"
    sink = StoreSink(FeatureStoreSink(path=str(root), flush_samples=2), LAYER_IDS, 128,
                     target_model.config.vocab_size, "tiny-qwen3")
    for step in range(2):
        sink.write(_capture(target_model, step, seed=step, n=3), step)
        sink.end_step(step)
    sink.close()
    capsys.readouterr()
    assert inspect_main([str(root), "--max-samples", "0", "--strict", "--verify-checksums", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "0..1" in out  # steps and policy versions 0..1
    assert inspect_main([str(tmp_path / "missing")]) == 2  # and the CLI does fail on what is not a store


def test_rows_of_an_unfinished_step_are_not_committed(tmp_path: Path, target_model) -> None:  # type: ignore[no-untyped-def]
    root = tmp_path / "store"
    sink = StoreSink(FeatureStoreSink(path=str(root), flush_samples=100), LAYER_IDS, 128,
                     target_model.config.vocab_size, "tiny-qwen3")
    sink.write(_capture(target_model, 0, seed=0, n=2), 0)
    sink.end_step(0)
    sink.write(_capture(target_model, 1, seed=1, n=3), 1)  # step 1 still in progress
    index = StoreIndex.open(root)
    assert index.num_samples == 2
    index.close()
    sink.close()


def test_missing_path_raises_naming_the_key(tmp_path: Path) -> None:
    for path in (None, ""):
        with pytest.raises(ValueError, match=r"actor_rollout_ref\.rollout\.drafter\.feature_store\.path: got None"):
            StoreSink(FeatureStoreSink(path=path), LAYER_IDS, 128, 505, "m")
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("dtype", ["int32", "bool", "nonsense", "Tensor", "float8"])
def test_non_floating_hidden_dtype_raises_naming_the_key(tmp_path: Path, dtype: str) -> None:
    cfg = FeatureStoreSink(path=str(tmp_path / "store"), hidden_dtype=dtype)
    with pytest.raises(ValueError, match=rf"drafter\.feature_store\.hidden_dtype: got '{dtype}', expected a floating"):
        StoreSink(cfg, LAYER_IDS, 128, 505, "m")
    assert not (tmp_path / "store").exists()
