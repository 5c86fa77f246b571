"""The drafter worker group: 2 real Ray actors forming a gloo process group, the draft sharded with
FSDP2, trained on the same rows as one in-process session: same losses, same published weights."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
import torch
from safetensors.torch import load_file
from speco_verl_helpers import tiny_qwen3

from verl_speco.online.capture import CapturedRows, OnlineCapture
from verl_speco.online.config import CaptureCaps, DrafterRunConfig
from verl_speco.online.publish import load_version
from verl_speco.online.session import DrafterSession, TargetHeadSnapshot
from verl_speco.train.config import OptimConfig

LAYER_IDS = (2, 4, 5)


@pytest.fixture(scope="module")
def local_ray() -> Iterator[Any]:
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def _rows(model: Any, version: int, n: int = 6) -> CapturedRows:
    g = torch.Generator().manual_seed(version)
    ids = torch.randint(3, model.config.vocab_size, (n, 14), generator=g)
    am = torch.ones_like(ids)
    lm = torch.zeros_like(ids)
    lm[:, 5:] = 1
    cap = OnlineCapture(LAYER_IDS, CaptureCaps(), seed=0, hidden_dtype=torch.float32)
    with torch.no_grad(), cap.hooks(model) as hooked:
        model(input_ids=ids, attention_mask=am)
        return cap.collect(hooked.pop_all(), ids, am, lm, version)


def test_rank_shares_of_a_draw() -> None:
    """Rows r, r + W, ... of the global draw; fewer rows than ranks: row r mod n (never empty)."""
    session: Any = object.__new__(DrafterSession)
    draw = [{"i": torch.tensor(i)} for i in range(5)]

    def share(rank: int, world: int, rows: list[dict[str, torch.Tensor]]) -> list[int]:
        session.rank, session.world = rank, world
        return [int(r["i"]) for r in session._rank_rows(rows)]

    assert share(0, 1, draw) == [0, 1, 2, 3, 4]
    assert (share(0, 2, draw), share(1, 2, draw)) == ([0, 2, 4], [1, 3])
    assert [share(r, 3, draw) for r in range(3)] == [[0, 3], [1, 4], [2]]
    assert [share(r, 3, draw[:1]) for r in range(3)] == [[0], [0], [0]]
    assert [share(r, 4, draw[:3]) for r in range(4)] == [[0], [1], [2], [0]]


def test_two_rank_fsdp2_group_trains_like_one_process(local_ray: Any, tmp_path: Path) -> None:
    from verl_speco.verl_integration.drafter_actor import DrafterGroup, start_drafter_group

    model = tiny_qwen3()
    target = tmp_path / "target"
    model.save_pretrained(target)
    cfg = DrafterRunConfig(enable=True, train_steps_per_round=3, micro_batch_size=4, max_staleness=1,
                           settings={"aux_layer_ids": list(LAYER_IDS), "ttt_steps": 2}, num_workers=2,
                           optim=OptimConfig(lr=3e-3), publish_dir=str(tmp_path / "publish"))
    group = start_drafter_group(cfg, str(target), "grp")
    assert isinstance(group, DrafterGroup) and len(group.actors) == 2
    assert ray.get([a.rank.remote() for a in group.actors]) == [0, 1]
    assert ray.get(group.layer_ids.remote()) == list(LAYER_IDS)
    initial = Path(ray.get(group.export_initial.remote(str(tmp_path / "initial"))))
    assert (initial / "config.json").is_file() and (initial / "model.safetensors").is_file()

    reference = DrafterSession(dataclasses.replace(cfg, num_workers=1, publish_dir=str(tmp_path / "ref")), target)
    assert reference.world == 1
    group_metrics, ref_metrics = [], []
    for version in (0, 1):
        rows, head = _rows(model, version), TargetHeadSnapshot.from_model(model, version)
        added = ray.get(group.add.remote([ray.put(rows.to_bytes())], ray.put(head.to_bytes())))
        assert added["rows_added"] == 6.0
        reference.add(rows, head)
        group_metrics.append(ray.get(group.train_round.remote()))
        ref_metrics.append(reference.train_round())
    for ours, theirs in zip(group_metrics, ref_metrics):
        assert ours["tokens"] == theirs["tokens"]  # the global draw, split over the ranks
        assert ours["loss"] == pytest.approx(theirs["loss"], rel=1e-4)

    published = ray.get(group.publish.remote())
    assert published["version"] == 1 and published["path"] is not None
    served = load_version(published["path"], published["version"])
    want = reference.engine_state()
    assert sorted(served) == sorted(want)
    for name, t in want.items():
        torch.testing.assert_close(served[name], t, atol=2e-5, rtol=1e-4, msg=name)
    start = load_file(initial / "model.safetensors")  # the export before training, gathered from the shards
    assert sorted(start) == sorted(want)
    moved = [n for n, t in want.items() if t.is_floating_point() and (t - start[n]).abs().max() > 1e-4]
    assert "fc.weight" in moved and any(n.startswith("midlayer.") for n in moved)
    for actor in group.actors:
        ray.kill(actor)
