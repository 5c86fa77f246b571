"""The trainer verifies shard checksums by default: one flipped tensor byte in a committed shard
stops training with an error naming the shard; `data.verify_checksums=false` opts out."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import overrides, run_failing

from feature_store.store import list_commits
from verl_speco.train import entry
from verl_speco.train.compose import load_config

RUN = ("data.shuffle=false", "data.eval_fraction=0.0", "run.total_steps=2", "run.eval_every=0", "run.save_every=0")


def flip_tensor_byte(shard: Path, field: str) -> None:
    """XOR the lowest bit of the first byte of `field`'s data (a bf16 mantissa bit: still finite)."""
    raw = bytearray(shard.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    begin, _ = json.loads(raw[8:8 + n])[field]["data_offsets"]
    raw[8 + n + begin] ^= 0x01
    shard.write_bytes(bytes(raw))


@pytest.fixture()
def flipped_store(tiny_store: Path, tmp_path: Path) -> tuple[Path, str]:
    store = shutil.copytree(tiny_store, tmp_path / "store")
    first = sorted(list_commits(store), key=lambda c: c.seq)[0].shard  # read first: no shuffle
    flip_tensor_byte(store / "shards" / first, "aux_hidden")
    return store, first


def test_verification_is_the_default() -> None:
    assert load_config(["target.path=/t", "data.store=/s"]).data.verify_checksums is True


def test_flipped_byte_stops_training_unless_opted_out(flipped_store: tuple[Path, str], tiny_target: Path,
                                                      tmp_path: Path) -> None:
    store, shard = flipped_store
    line = run_failing(["--nproc-per-node", "1", *overrides(tiny_target, store, tmp_path / "out"), *RUN])
    assert shard in line and "checksum" in line and "data.verify_checksums=false" in line
    assert not (tmp_path / "out" / "ckpt").exists()  # nothing was trained on the corrupt shard
    # the opt-out trains on the store as it is
    out = tmp_path / "opt_out"
    assert entry.main([*overrides(tiny_target, store, out), *RUN, "data.verify_checksums=false"]) == 0
    assert (out / "ckpt" / "step_2" / "trainer" / "state.json").is_file()


@pytest.mark.dist
def test_flipped_byte_under_torchrun_exits_2_with_one_line_per_rank(flipped_store: tuple[Path, str],
                                                                    tiny_target: Path, tmp_path: Path) -> None:
    store, shard = flipped_store
    lines = run_failing(["--nproc-per-node", "2", *overrides(tiny_target, store, tmp_path / "out"), *RUN], ranks=2)
    assert [line.split(": ")[2] for line in lines.splitlines()] == ["rank 0", "rank 1"]
    assert lines.count(shard) == 2 and lines.count("checksum") >= 2
