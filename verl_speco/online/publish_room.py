"""Start-up check that the publish directory has room for the draft versions it will hold: /dev/shm in
a container is 64 MiB without `--ipc=host` / `--shm-size`, while `VERSIONS_ALIVE` versions of a bf16
Qwen3-8B DFlash draft take about 2 GiB each; without it the first publish fails late, with "No space left"."""

from __future__ import annotations

import logging
import math
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from verl_speco.online.publish import KEEP

logger = logging.getLogger(__name__)
VERSIONS_ALIVE = KEEP + 1
GIB = 1 << 30
DOCKER_DEFAULT_SHM = 64 << 20
SHM = Path("/dev/shm")


class PublishRoomError(ValueError):
    """The publish directory's filesystem has less free space than the versions need."""


def draft_bytes(draft_dir: str | Path) -> int:
    """Bytes of the draft export's tensors: the sizes of its `*.safetensors` files."""
    files = sorted(Path(draft_dir).glob("*.safetensors"))
    if not files:
        raise ValueError(f"draft export {str(draft_dir)!r}: no *.safetensors file, expected the draft's weights")
    return sum(f.stat().st_size for f in files)


def existing_parent(path: Path) -> Path:
    """`path`, or its nearest ancestor that exists (where the directory will be created)."""
    for candidate in (path, *path.parents):
        if candidate.exists():
            return candidate
    return Path("/")


def check_publish_room(publish_dir: str | Path, version_bytes: int, versions: int = VERSIONS_ALIVE,
                       disk_usage: Callable[[Path], Any] | None = None) -> int:
    """The bytes `versions` versions of `version_bytes` need; `PublishRoomError` naming the directory, its
    free bytes, that need and the fix when there is less free space."""
    if version_bytes < 1 or versions < 1:
        raise ValueError(f"check_publish_room: got version_bytes={version_bytes}, versions={versions}; "
                         "expected both >= 1")
    where = Path(publish_dir)
    needed = versions * version_bytes
    free = int((disk_usage or shutil.disk_usage)(existing_parent(where)).free)
    if free >= needed:
        return needed
    message = (f"actor_rollout_ref.rollout.drafter.publish_dir {str(where)!r}: {free} bytes ({free / GIB:.2f} GiB) "
               f"free on its filesystem, expected at least {needed} bytes ({needed / GIB:.2f} GiB): {versions} "
               f"versions of the draft alive at once ({KEEP} kept and the one being written) x {version_bytes} "
               f"bytes ({version_bytes / GIB:.2f} GiB) each. ")
    if where == SHM or SHM in where.parents:
        size = math.ceil(needed / GIB) + 1
        message += (f"It is in shared memory, which a Docker container gets {DOCKER_DEFAULT_SHM >> 20} MiB of by "
                    f"default: start the container with --ipc=host, or with --shm-size={size}g or more (NCCL, "
                    "vLLM and Ray use /dev/shm too; docs/deploy.md). ")
    raise PublishRoomError(message + "Or publish elsewhere: set actor_rollout_ref.rollout.drafter.publish_dir "
                           "(PUBLISH_DIR for the launchers) to a local directory with room.")


def require_publish_room(publish_dir: str | Path, draft_dir: str | Path,
                         disk_usage: Callable[[Path], Any] | None = None) -> int | None:
    """`check_publish_room` for versions the size of the export in `draft_dir`; the bytes needed, or None
    with a warning when `draft_dir` is not visible here (written on another node)."""
    if not Path(draft_dir).is_dir():
        logger.warning("publish room not checked: the draft export %s is not visible from this node; "
                       "%s must hold %d versions of it", draft_dir, publish_dir, VERSIONS_ALIVE)
        return None
    return check_publish_room(publish_dir, draft_bytes(draft_dir), VERSIONS_ALIVE, disk_usage)
