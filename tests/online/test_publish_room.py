"""The start-up check of the publish directory's room (verl_speco/online/publish_room.py).

Filesystems are faked (`disk_usage` returning chosen free bytes): Docker's default 64 MiB /dev/shm
refuses three versions of a 2 GiB draft naming the numbers and the docker flags; enough room passes.
The trainer runs the check after the initial export and before the rollout engines are configured
(a stand-in trainer with a faked drafter group, as in tests/deploy/test_engine_refusal.py).
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from omegaconf import OmegaConf
from safetensors.torch import save_file

from verl_speco.online import publish_room
from verl_speco.online.publish import KEEP, write_version
from verl_speco.online.publish_room import (
    PublishRoomError,
    check_publish_room,
    draft_bytes,
    require_publish_room,
)

GIB = 1 << 30


def fake_disk(free: int, seen: list[Path] | None = None) -> Any:
    def usage(path: Path) -> SimpleNamespace:
        if seen is not None:
            seen.append(Path(path))
        return SimpleNamespace(total=free, used=0, free=free)
    return usage


def test_three_versions_of_a_2_gib_draft_do_not_fit_dockers_default_shm() -> None:
    assert KEEP + 1 == publish_room.VERSIONS_ALIVE == 3
    seen: list[Path] = []
    with pytest.raises(PublishRoomError) as err:
        check_publish_room("/dev/shm/verl_speco/qwen3_8b_dflash_vllm", 2 * GIB, disk_usage=fake_disk(64 << 20, seen))
    text = str(err.value)
    assert "publish_dir '/dev/shm/verl_speco/qwen3_8b_dflash_vllm': 67108864 bytes (0.06 GiB) free" in text
    assert "at least 6442450944 bytes (6.00 GiB): 3 versions" in text and "x 2147483648 bytes (2.00 GiB) each" in text
    assert "--ipc=host" in text and "--shm-size=7g or more" in text and "PUBLISH_DIR" in text
    assert seen and all(p.exists() for p in seen)  # asked about a directory that exists (the run creates its own)


def test_enough_room_passes_and_returns_the_bytes_needed() -> None:
    assert check_publish_room("/dev/shm/x", 2 * GIB, disk_usage=fake_disk(6 * GIB)) == 6 * GIB  # exactly enough
    with pytest.raises(PublishRoomError, match="6442450943 bytes"):
        check_publish_room("/dev/shm/x", 2 * GIB, disk_usage=fake_disk(6 * GIB - 1))
    assert check_publish_room("/dev/shm/x", 2 * GIB, versions=1, disk_usage=fake_disk(2 * GIB)) == 2 * GIB


def test_outside_shared_memory_the_docker_flags_are_not_offered(tmp_path: Path) -> None:
    with pytest.raises(PublishRoomError) as err:
        check_publish_room(tmp_path / "publish", 100, disk_usage=fake_disk(299))
    assert "--shm-size" not in str(err.value) and "300 bytes" in str(err.value) and "PUBLISH_DIR" in str(err.value)
    with pytest.raises(ValueError, match="version_bytes=0"):
        check_publish_room(tmp_path, 0)


def test_a_versions_bytes_are_its_exports_safetensors_files(tmp_path: Path) -> None:
    """A published version holds the same tensors as the export: the publish of those tensors has the
    file bytes the check counts (its buckets' file_bytes), within the safetensors headers."""
    state = {"fc.weight": torch.randn(64, 32).to(torch.bfloat16), "norm.weight": torch.ones(32, dtype=torch.bfloat16)}
    export = tmp_path / "export"
    export.mkdir()
    save_file(state, str(export / "model.safetensors"))
    (export / "config.json").write_text("{}")
    size = (export / "model.safetensors").stat().st_size
    assert draft_bytes(export) == size and size >= (64 * 32 + 32) * 2
    published = write_version(tmp_path / "publish", 1, state)
    on_disk = sum(f.stat().st_size for f in published.path.glob("*.safetensors"))
    assert published.total_bytes == (64 * 32 + 32) * 2 and abs(on_disk - size) < 1024
    assert require_publish_room(tmp_path / "publish", export, fake_disk(3 * size)) == 3 * size
    with pytest.raises(ValueError, match="no \\*.safetensors file"):
        draft_bytes(tmp_path / "publish")


def test_a_draft_on_another_node_is_said_unchecked(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING", logger="verl_speco.online.publish_room"):
        assert require_publish_room("/dev/shm/x", tmp_path / "elsewhere", fake_disk(0)) is None
    assert "publish room not checked" in caplog.text and "elsewhere" in caplog.text


class _Configured(Exception):
    """The stand-in trainer went on to configure the rollout engines: the room check passed."""


def _setup(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, free: int) -> None:
    from verl_speco.deploy import engine_check
    from verl_speco.online.config import DrafterRunConfig
    from verl_speco.verl_integration import drafter_actor, trainer_setup
    from verl_speco.verl_integration.trainer import SpecoTrainerMixin

    def export_initial(out: str) -> str:
        save_file({"w": torch.zeros(1024, dtype=torch.bfloat16)}, str(Path(out) / "model.safetensors"))
        return out

    def configured() -> None:
        raise _Configured

    group = SimpleNamespace(layer_ids=SimpleNamespace(remote=lambda: [1]),
                            target_shape=SimpleNamespace(remote=lambda: {"hidden_size": 8, "vocab_size": 32}),
                            export_initial=SimpleNamespace(remote=export_initial),
                            engine_format=SimpleNamespace(remote=configured))
    monkeypatch.setattr(engine_check, "installed_engine_version", lambda name: "0.32.0")
    monkeypatch.setattr(drafter_actor, "start_drafter_group", lambda *args: group)
    monkeypatch.setattr(trainer_setup.ray, "get", lambda ref: ref)
    monkeypatch.setattr(trainer_setup, "target_dir", lambda config: "/t")
    out = tmp_path / f"initial_{free}"
    out.mkdir()
    monkeypatch.setattr(trainer_setup.tempfile, "mkdtemp", lambda **kwargs: str(out))
    monkeypatch.setattr(publish_room.shutil, "disk_usage", fake_disk(free))
    stand_in: Any = object.__new__(type("Trainer", (SpecoTrainerMixin,), {}))
    stand_in.speco = DrafterRunConfig(enable=True, family="eagle3", mode="online",
                                      publish_dir="/dev/shm/verl_speco/room_check")
    stand_in.config = OmegaConf.create({"actor_rollout_ref": {"rollout": {"name": "vllm"}},
                                        "trainer": {"experiment_name": "room"}})
    stand_in._setup()


def test_the_trainer_refuses_before_the_engines_are_configured(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    with pytest.raises(PublishRoomError, match=r"'/dev/shm/verl_speco/room_check': 64 bytes .*--ipc=host"):
        _setup(monkeypatch, tmp_path, 64)
    with pytest.raises(_Configured):
        _setup(monkeypatch, tmp_path, 64 * GIB)
