"""Versioned bucketed publishing: bucket plans, bit-exact round trips through real safetensors files,
forward-only versions and pruning (the receiver's verification: tests/engines/test_publish_verify.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from verl_speco.online.publish import (
    FORMAT,
    default_publish_dir,
    load_version,
    plan_buckets,
    read_manifest,
    verified_buckets,
    verify_version,
    write_version,
)


def _bytes(n: int) -> torch.Tensor:
    return torch.zeros(n, dtype=torch.uint8)


def test_plan_buckets_docstring_example() -> None:
    state = {"a": _bytes(3), "b": _bytes(3), "c": _bytes(5), "d": _bytes(1)}
    assert plan_buckets(state, 6) == [["a", "b"], ["c", "d"]]


def test_plan_buckets_counts_bytes_not_elements() -> None:
    state = {"x": torch.zeros(2, dtype=torch.float32), "y": torch.zeros(2, dtype=torch.int16),
             "z": torch.zeros(4, dtype=torch.bool)}  # 8, 4, 4 bytes
    assert plan_buckets(state, 12) == [["x", "y"], ["z"]]
    assert plan_buckets(state, 16) == [["x", "y", "z"]]
    assert plan_buckets(state, 8) == [["x"], ["y", "z"]]
    assert plan_buckets(state, 7) == [["x"], ["y"], ["z"]]


def test_plan_buckets_edges() -> None:
    assert plan_buckets({}, 10) == []
    big = {"a": _bytes(1), "huge": _bytes(100), "b": _bytes(1), "c": _bytes(1)}
    assert plan_buckets(big, 10) == [["a"], ["huge"], ["b", "c"]]  # an oversized tensor stands alone
    assert plan_buckets(big, 1) == [["a"], ["huge"], ["b"], ["c"]]
    assert plan_buckets(big, 10**9) == [["a", "huge", "b", "c"]]
    assert plan_buckets({"e": _bytes(0), "f": _bytes(4), "g": _bytes(0)}, 4) == [["e", "f", "g"]]
    for bad in (0, -1):
        with pytest.raises(ValueError, match=f"bucket_bytes: got {bad}, expected >= 1"):
            plan_buckets(big, bad)


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "fc.weight": torch.randn(6, 10, generator=g),                                  # 240 B
        "norm.weight": torch.randn(10, generator=g).to(torch.bfloat16),                  # 20 B
        "d2t": torch.randint(-(2**40), 2**40, (7,), generator=g, dtype=torch.int64),     # 56 B
        "t2d": torch.rand(13, generator=g) < 0.5,                                        # 13 B
        "lm_head.weight": torch.randn(4, 8, generator=g).to(torch.bfloat16),             # 64 B
        "scale": torch.tensor(-0.0),                                                     # 4 B
    }


def _bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.is_floating_point():
        ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
        return torch.equal(a.contiguous().view(ints), b.contiguous().view(ints))
    return torch.equal(a, b)


@pytest.mark.parametrize("bucket_bytes", [1, 100, 300, 1 << 20])
def test_write_and_iter_round_trip_bit_exact(tmp_path: Path, bucket_bytes: int) -> None:
    state = _state()
    pub = write_version(tmp_path / "pub", 7, state, bucket_bytes=bucket_bytes, meta={"step": 3})
    assert pub.version == 7 and pub.path == tmp_path / "pub" / "v000007" and pub.path.is_dir()
    assert pub.total_bytes == 240 + 20 + 56 + 13 + 64 + 4
    plan = plan_buckets(state, bucket_bytes)
    assert pub.num_buckets == len(plan)
    manifest = read_manifest(pub.path)
    assert manifest["format"] == FORMAT and manifest["version"] == 7 and manifest["meta"] == {"step": 3}
    assert manifest["total_bytes"] == pub.total_bytes
    assert [b["names"] for b in manifest["buckets"]] == plan
    assert [b["file"] for b in manifest["buckets"]] == [f"bucket_{i:03d}.safetensors" for i in range(len(plan))]
    for b in manifest["buckets"]:
        assert b["bytes"] == sum(state[n].numel() * state[n].element_size() for n in b["names"])
        assert b["bytes"] <= bucket_bytes or len(b["names"]) == 1
    seen: list[str] = []
    for bucket, names in zip(verified_buckets(pub.path, verify_version(pub.path, 7)), plan):
        assert [n for n, _ in bucket] == names  # publish order
        for name, tensor in bucket:
            assert _bit_equal(tensor, state[name]), name
            seen.append(name)
    assert seen == list(state)
    assert sorted(p.name for p in (tmp_path / "pub").iterdir()) == ["v000007"]  # no temp dir left


def test_noncontiguous_tensors_publish_their_values(tmp_path: Path) -> None:
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    pub = write_version(tmp_path, 0, {"t": base.T})
    ((name, got),) = load_version(pub.path, 0).items()
    assert name == "t" and torch.equal(got, base.T.contiguous())


def test_versions_only_move_forward_and_pruning_keeps_newest(tmp_path: Path) -> None:
    state = {"w": torch.ones(3)}
    for v in (1, 2, 3, 5):
        write_version(tmp_path, v, {"w": torch.full((3,), float(v))}, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v000003", "v000005"]
    with pytest.raises(FileExistsError, match="version 5 was already published"):
        write_version(tmp_path, 5, state, keep=2)
    with pytest.raises(FileExistsError, match="version 3 was already published"):
        write_version(tmp_path, 3, state, keep=2)
    w = load_version(tmp_path / "v000005", 5)["w"]
    assert torch.equal(w, torch.full((3,), 5.0))  # untouched by the refused re-publish
    write_version(tmp_path, 6, state, keep=3)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v000003", "v000005", "v000006"]
    write_version(tmp_path, 7, state, keep=1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v000007"]


def test_an_older_version_than_the_newest_is_refused(tmp_path: Path) -> None:
    """'versions only increase': a version below the newest published one (here pruned already, so
    its directory is gone) must not be written; otherwise the returned handle points at a directory
    that pruning deletes right away (v1 is the oldest of v1, v2, v3)."""
    state = {"w": torch.ones(3)}
    for v in (1, 2, 3):
        write_version(tmp_path, v, state, keep=2)
    assert not (tmp_path / "v000001").exists()
    with pytest.raises((FileExistsError, ValueError), match="version"):
        pub = write_version(tmp_path, 1, state, keep=2)
        assert pub.path.is_dir(), "the returned version directory was deleted by pruning"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v000002", "v000003"]


def test_write_version_rejects_bad_input(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="version: got -1, expected >= 0"):
        write_version(tmp_path, -1, {"w": torch.ones(1)})
    with pytest.raises(ValueError, match="state: empty"):
        write_version(tmp_path, 0, {})
    assert list(tmp_path.iterdir()) == []


def test_default_publish_dir_is_per_run() -> None:
    a, b = default_publish_dir("run-a"), default_publish_dir("run-b")
    assert a.name == "run-a" and b.name == "run-b" and a.parent == b.parent
    assert a.parent.name == "verl_speco"
