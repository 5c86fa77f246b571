"""In-process training runs (world size 1, real gloo process group, real FSDP2): checkpoint layout,
exact resume, non-finite step skipping, held-out split."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import overrides, write_store
from safetensors.torch import load_file

from drafters.eagle3.export import load_export
from feature_store import StoreReader
from verl_speco.train.checkpoint import CheckpointError, list_checkpoints, resolve_resume
from verl_speco.train.compose import load_config
from verl_speco.train.config import DataSection
from verl_speco.train.data import train_shard_set
from verl_speco.train.loop import run
from verl_speco.train.metrics_log import is_timing_metric, read_jsonl


def _train(*args: str) -> dict:
    return run(load_config(list(args)))


def _tensors_equal(a: Path, b: Path) -> bool:
    ta, tb = load_file(str(a)), load_file(str(b))
    return ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)


@pytest.fixture(scope="module")
def full_run(tiny_target: Path, tiny_store: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("full")
    summary = _train(*overrides(tiny_target, tiny_store, out))
    assert summary["step"] == 6 and summary["skipped_steps"] == 0
    return out


def test_checkpoint_layout_and_export(full_run: Path) -> None:
    assert [p.name for p in list_checkpoints(full_run / "ckpt")] == ["step_3", "step_6"]
    ck = full_run / "ckpt" / "step_6"
    trainer = ck / "trainer"
    for name in ("model.safetensors", "optimizer.safetensors", "optimizer.json", "rng_rank0.safetensors",
                 "rng_rank0.json", "reader_rank0.json", "state.json"):
        assert (trainer / name).is_file(), name
    assert not [p for p in ck.rglob("*") if p.suffix in (".pt", ".pth", ".pkl", ".bin")]  # never pickle
    state = json.loads((trainer / "state.json").read_text())
    assert (state["step"], state["world_size"], state["skipped_steps"]) == (6, 1, 0)
    assert state["scheduler"]["total_steps"] == 6 and state["config"]["run"]["total_steps"] == 6
    reader = json.loads((trainer / "reader_rank0.json").read_text())
    assert reader["position"] == (6 * 2) % 24 and reader["epoch"] == 0  # 6 steps x 2 samples of 24
    # the engine-ready export holds the trained weights
    config = json.loads((ck / "export" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    exported, _ = load_export(ck / "export")
    trained = load_file(str(trainer / "model.safetensors"))
    assert torch.equal(exported["fc.weight"].float(), trained["fc.weight"])
    assert "embed_tokens.weight" not in trained  # frozen target pieces are not trainer state
    opt = json.loads((trainer / "optimizer.json").read_text())
    assert {t.split("/")[0] for t in load_file(str(trainer / "optimizer.safetensors"))} == set(trained) - {"d2t", "t2d"}
    assert opt["param_groups"][0]["betas"] == [0.9, 0.95]


def test_metrics_jsonl_and_tensorboard(full_run: Path) -> None:
    train = read_jsonl(full_run / "metrics.jsonl", "train")
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5, 6]
    for key in ("loss", "lr", "grad_norm", "tokens_per_s", "skipped_steps", "acc_step0", "acc_step2", "sim_accept_len",
                "time_read_s", "time_batch_s", "time_forward_s", "time_loss_s", "time_backward_s", "time_optim_s"):
        assert key in train[0], key
    for r in train:  # the stages are parts of the step
        stages = sum(r[f"time_{s}_s"] for s in ("read", "batch", "forward", "loss", "backward", "optim"))
        assert min(r[f"time_{s}_s"] for s in ("forward", "backward", "optim")) > 0 and stages <= r["step_time_s"]
    assert train[0]["lr"] == pytest.approx(3e-3 / 2)  # warmup_steps=2: step 0 runs at lr / 2
    assert train[-1]["lr"] == pytest.approx(0.0)      # cosine to min_lr_ratio=0 at the last step
    evals = read_jsonl(full_run / "metrics.jsonl", "eval")
    assert [r["step"] for r in evals] == [3, 6]
    assert 1.0 <= evals[-1]["sim_accept_len"] <= 4.0  # ttt_steps=3: at most 1 + 3
    assert list((full_run / "tensorboard").glob("events.out.tfevents.*"))


def test_interrupted_and_resumed_run_equals_uninterrupted(full_run: Path, tiny_target: Path, tiny_store: Path,
                                                           tmp_path: Path) -> None:
    base = overrides(tiny_target, tiny_store, tmp_path)
    first = _train(*base, "run.stop_after=4")
    assert first["step"] == 4
    assert [p.name for p in list_checkpoints(tmp_path / "ckpt")] == ["step_3", "step_4"]
    # simulate a crash after step 4 whose checkpoint never completed: resume must use step_3
    shutil.rmtree(tmp_path / "ckpt" / "step_4")
    (tmp_path / "ckpt" / "step_5.tmp" / "trainer").mkdir(parents=True)
    with pytest.raises(CheckpointError, match="already holds checkpoints"):
        _train(*base)  # a fresh run must not mix with the old checkpoints
    second = _train(*base, "run.resume=true")
    assert second["resumed_from"].endswith("step_3") and second["step"] == 6
    for kind in ("train", "eval"):
        want, got = read_jsonl(full_run / "metrics.jsonl", kind), read_jsonl(tmp_path / "metrics.jsonl", kind)
        assert [r["step"] for r in got] == [r["step"] for r in want]
        def strip(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:  # wall-clock figures differ run to run
            return [{k: v for k, v in r.items() if not is_timing_metric(k)} for r in rows]

        assert strip(got) == strip(want)  # bit-exact
    for name in ("model.safetensors", "optimizer.safetensors"):
        assert _tensors_equal(full_run / "ckpt/step_6/trainer" / name, tmp_path / "ckpt/step_6/trainer" / name)


def test_resume_from_explicit_path(full_run: Path) -> None:
    assert resolve_resume(str(full_run / "ckpt" / "step_3"), full_run / "ckpt") == full_run / "ckpt" / "step_3"
    assert resolve_resume(True, full_run / "ckpt") == full_run / "ckpt" / "step_6"
    assert resolve_resume(False, full_run / "ckpt") is None
    with pytest.raises(CheckpointError, match="not a complete checkpoint"):
        resolve_resume(str(full_run), full_run / "ckpt")


def test_non_finite_step_is_skipped_and_counted(tiny_target: Path, tmp_path: Path) -> None:
    store = write_store(tmp_path / "nan_store", 16, seed=3, nan_at=5)  # step 3 reads samples 4 and 5
    out = tmp_path / "run"
    summary = _train(*overrides(tiny_target, store, out), "data.shuffle=false", "data.eval_fraction=0.0",
                     "run.total_steps=4", "run.save_every=1", "run.eval_every=0", "optim.schedule=constant")
    assert summary["skipped_steps"] == 1
    train = read_jsonl(out / "metrics.jsonl", "train")
    assert [r["skipped"] for r in train] == [0, 0, 1, 0]
    assert [r["skipped_steps"] for r in train] == [0, 0, 1, 1]
    assert train[2]["loss"] == "nan"
    assert all(isinstance(r["loss"], float) for i, r in enumerate(train) if i != 2)
    ck = out / "ckpt"
    for name in ("model.safetensors", "optimizer.safetensors"):  # the skipped step changed nothing
        assert _tensors_equal(ck / "step_2/trainer" / name, ck / "step_3/trainer" / name)
    assert not _tensors_equal(ck / "step_3/trainer/model.safetensors", ck / "step_4/trainer/model.safetensors")
    assert all(torch.isfinite(t).all() for t in load_file(str(ck / "step_4/trainer/model.safetensors")).values()
               if t.is_floating_point())


def test_eval_fraction_holds_out_whole_shards(tiny_store: Path) -> None:
    keep, held = train_shard_set(DataSection(store=str(tiny_store), eval_fraction=0.25))
    assert keep is not None and list(keep.values()) == [3] and [c.seq for c in held] == [3]
    with StoreReader(tiny_store, shard_set=keep, prefetch=0) as reader:
        assert len(reader) == 24
    two = tiny_store.parent / "two_writers"
    for rank in (0, 1):  # 3 shards of 4 samples each
        write_store(two, 12, seed=rank, flush_samples=4, rank=rank)
    keep, held = train_shard_set(DataSection(store=str(two), eval_fraction=0.2))  # 4.8 of 24 -> 2 shards
    assert keep is not None and sorted(keep.values()) == [2, 2] and sorted(c.seq for c in held) == [2, 2]
    with pytest.raises(ValueError, match="eval_fraction"):
        train_shard_set(DataSection(store=str(write_store(tiny_store.parent / "one_shard", 4, flush_samples=64)),
                                    eval_fraction=0.5))


def test_mixed_precision_token_budget_and_draft_vocab(tiny_target: Path, tiny_store: Path, tmp_path: Path) -> None:
    summary = _train(*overrides(tiny_target, tiny_store, tmp_path), "run.mixed_precision=bfloat16",
                     "drafter.settings.draft_vocab_size=32",
                     "data.token_budget=40", "optim.grad_accum=2", "run.total_steps=2", "run.eval_every=0")
    assert summary["skipped_steps"] == 0
    train = read_jsonl(tmp_path / "metrics.jsonl", "train")
    assert all(isinstance(r["loss"], float) and 0 < r["tokens"] <= 2 * 40 for r in train)
    weights = load_file(str(tmp_path / "ckpt/step_2/trainer/model.safetensors"))
    assert weights["fc.weight"].dtype == torch.float32  # bf16 compute, fp32 master weights
    assert weights["lm_head.weight"].shape == (32, 32) and int(weights["t2d"].sum()) == 32
    exported, _ = load_export(tmp_path / "ckpt/step_2/export")
    assert torch.equal(exported["d2t"], weights["d2t"])  # reduced vocab: offsets exported
    # the draft vocab = the 32 most frequent loss-masked target ids of the TRAINING shards
    keep, _ = train_shard_set(DataSection(store=str(tiny_store), eval_fraction=0.25))
    with StoreReader(tiny_store, shard_set=keep, shuffle=False, prefetch=0) as reader:
        counts = torch.zeros(64, dtype=torch.int64)
        for _, sample in zip(range(len(reader)), reader.iter_samples()):
            counts += torch.bincount(sample["input_ids"][sample["loss_mask"].bool()], minlength=64)
    order = sorted(range(64), key=lambda i: (-int(counts[i]), i))[:32]
    assert torch.equal(torch.nonzero(weights["t2d"]).flatten(), torch.tensor(sorted(order)))



def test_fsdp2_shards_trainable_and_replicates_frozen(tiny_target: Path) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from drafters import get_family
    from drafters.common.target import TargetHead
    from verl_speco.train.distributed import apply_fsdp, init_distributed

    cfg = load_config([f"target.path={tiny_target}", "data.store=/unused", "run.device=cpu"])
    device, created = init_distributed(cfg)
    assert created and dist.get_world_size() == 1
    try:
        family = get_family("eagle3")
        model = family.build(family.config_cls(ttt_steps=2), TargetHead.from_pretrained(tiny_target))
        units = apply_fsdp(model, device, cfg.run.mixed_precision, cfg.dist.reshard_after_forward)
        assert units[-1] is model and isinstance(model, FSDPModule)
        assert {type(u).__name__ for u in units[:-1]} >= {"FSDPLinear", "FSDPEagle3MidLayer"}
        for name, p in model.named_parameters():
            assert isinstance(p, DTensor) == p.requires_grad, name  # frozen embedding: plain, replicated
    finally:
        dist.destroy_process_group()


def test_prepass_denominators_equal_retained_graphs(tiny_target: Path, tiny_store: Path, tmp_path: Path) -> None:
    """optim.denominators=prepass (one backward per micro-batch) optimises the same global loss."""
    for mode in ("retain", "prepass"):
        _train(*overrides(tiny_target, tiny_store, tmp_path / mode), f"optim.denominators={mode}",
               "optim.grad_accum=3", "run.total_steps=3", "run.eval_every=0")
    a, b = (read_jsonl(tmp_path / m / "metrics.jsonl") for m in ("retain", "prepass"))
    assert [r["loss"] for r in a] == pytest.approx([r["loss"] for r in b], rel=1e-6)
    assert [r["grad_norm"] for r in a] == pytest.approx([r["grad_norm"] for r in b], rel=1e-5)
    wa, wb = (load_file(str(tmp_path / m / "ckpt/step_3/trainer/model.safetensors")) for m in ("retain", "prepass"))
    assert all(torch.allclose(wa[k].float(), wb[k].float(), atol=1e-6) for k in wa)
