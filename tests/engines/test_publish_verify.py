"""The receiver's verification of a published version (`publish.verify_version`): every corruption of
publish_faults.py, a wrong shape/dtype/name set against the live spec, non-finite weights, an old
directory offered under a new version, and a bucket changed between verification and loading."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from verl_speco.online.publish import (
    PublishRejected,
    checkpoint_spec,
    load_version,
    read_manifest,
    tensor_spec,
    verified_buckets,
    verify_version,
    write_version,
)

from .publish_faults import CORRUPTIONS, rewrite_manifest, truncate


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


def _spec(state: dict[str, torch.Tensor]) -> dict[str, tuple[tuple[int, ...], str]]:
    return {n: tensor_spec(t) for n, t in state.items()}


def test_a_good_version_verifies_against_the_live_spec(tmp_path: Path) -> None:
    state = _state()
    pub = write_version(tmp_path, 3, state, bucket_bytes=100)
    manifest = verify_version(pub.path, 3, _spec(state))
    assert all(b["checksum"].startswith("s64x4k:") for b in manifest["buckets"])
    assert all(b["file_bytes"] == (pub.path / b["file"]).stat().st_size for b in manifest["buckets"])
    got = load_version(pub.path, 3, _spec(state))
    assert list(got) == list(state)
    assert all(torch.equal(got[n].reshape(-1).view(torch.uint8), state[n].reshape(-1).view(torch.uint8)) for n in state)


@pytest.mark.parametrize("name", list(CORRUPTIONS))
def test_every_corruption_is_refused_with_its_reason(tmp_path: Path, name: str) -> None:
    corrupt, reason, message = CORRUPTIONS[name]
    state = _state()
    pub = write_version(tmp_path, 2, state, bucket_bytes=100)
    assert len(list(pub.path.glob("bucket_*"))) >= 3
    corrupt(pub.path)
    with pytest.raises(PublishRejected, match=message) as info:
        verify_version(pub.path, 2, _spec(state))
    assert info.value.reason == reason


def test_a_wrong_shape_or_dtype_or_name_set_is_refused_against_the_live_spec(tmp_path: Path) -> None:
    state = _state()
    live = _spec(state)
    for version, (name, bad) in enumerate([("fc.weight", torch.zeros(6, 11)),
                                           ("norm.weight", torch.zeros(10, dtype=torch.float32))], start=1):
        pub = write_version(tmp_path, version, {**state, name: bad})
        with pytest.raises(PublishRejected, match=f"{name}: ") as info:
            verify_version(pub.path, version, live)
        assert info.value.reason == "spec"
        verify_version(pub.path, version)  # internally consistent: only the live spec can see it
    pub = write_version(tmp_path, 3, {k: v for k, v in state.items() if k != "d2t"})
    with pytest.raises(PublishRejected, match="missing \\['d2t'\\], unexpected \\[\\]"):
        verify_version(pub.path, 3, live)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), -float("inf")])
def test_non_finite_weights_are_refused(tmp_path: Path, value: float) -> None:
    state = _state()
    pub = write_version(tmp_path, 1, {**state, "lm_head.weight": torch.full((4, 8), value, dtype=torch.bfloat16)})
    with pytest.raises(PublishRejected, match="lm_head.weight has 32 non-finite values of 32") as info:
        verify_version(pub.path, 1, _spec(state))
    assert info.value.reason == "non_finite"


def test_an_old_directory_offered_under_a_new_version_is_refused(tmp_path: Path) -> None:
    state = _state()
    old = write_version(tmp_path / "a", 2, state)
    with pytest.raises(PublishRejected, match="offered as version 7, but the manifest says 2") as info:
        verify_version(old.path, 7, _spec(state))
    assert info.value.reason == "version"
    renamed = tmp_path / "a" / "v000007"
    old.path.rename(renamed)  # the directory renamed, the manifest still says 2
    with pytest.raises(PublishRejected, match="manifest says 2 and the directory is 'v000007'"):
        verify_version(renamed, 7, _spec(state))
    rewrite_manifest(renamed, lambda m: m.update(version=9))
    with pytest.raises(PublishRejected, match="the directory is 'v000007'"):
        verify_version(renamed, 9, _spec(state))


def test_a_bucket_changed_after_verification_is_refused_while_loading(tmp_path: Path) -> None:
    pub = write_version(tmp_path, 1, _state(), bucket_bytes=100)
    manifest = verify_version(pub.path, 1)
    it = verified_buckets(pub.path, manifest)
    next(it)
    truncate(pub.path, 1)
    with pytest.raises(PublishRejected, match="truncated or torn"):
        next(it)


def test_checkpoint_spec_reads_headers(tmp_path: Path) -> None:
    state = _state()
    save_file(dict(list(state.items())[:3]), str(tmp_path / "model-00001.safetensors"))
    save_file(dict(list(state.items())[3:]), str(tmp_path / "model-00002.safetensors"))
    assert checkpoint_spec(tmp_path) == _spec(state)
    with pytest.raises(FileNotFoundError, match="no \\*.safetensors"):
        checkpoint_spec(tmp_path / "nothing")


def test_read_manifest_checks_structure(tmp_path: Path) -> None:
    pub = write_version(tmp_path, 4, {"a": torch.ones(2)})
    assert read_manifest(pub.path)["version"] == 4
    rewrite_manifest(pub.path, lambda m: m["buckets"][0].update(file="../escape.safetensors"))
    with pytest.raises(PublishRejected, match="plain file name"):
        read_manifest(pub.path)


