"""Publishing draft weights as versioned, bucketed safetensors files (shared memory by default).

A published version is a directory, written atomically (temp dir + rename):

    <publish_dir>/v000042/
        manifest.json        {"version": 42, "format": "verl_speco.draft_publish/1",
                              "buckets": [{"file": "bucket_000.safetensors", "bytes": N,
                                           "names": [...]}, ...], "total_bytes": ..., "meta": {...}}
        bucket_000.safetensors   tensors in checkpoint names (the engine's `load_weights` input)
        bucket_001.safetensors   ...

Buckets bound the memory a receiver holds at once (each is memory-mapped and loaded in turn).
Tensors never travel pickled: the engine worker opens the files (a file handle on /dev/shm,
i.e. shared memory, when `publish_dir` is under it) and reads the tensors with safetensors.
Older versions are deleted once a newer one is written (`keep` newest are kept).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

FORMAT = "verl_speco.draft_publish/1"
MANIFEST = "manifest.json"
DEFAULT_BUCKET_BYTES = 256 << 20


def default_publish_dir(run_name: str) -> Path:
    """Shared memory when the host has it (/dev/shm), else the temp dir."""
    shm = Path("/dev/shm")
    root = shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())
    return root / "verl_speco" / run_name


@dataclass(frozen=True)
class PublishedDraft:
    version: int
    path: Path  # the version directory (holds manifest.json)
    total_bytes: int
    num_buckets: int


def plan_buckets(state: Mapping[str, torch.Tensor], bucket_bytes: int) -> list[list[str]]:
    """Group names in order into buckets of at most `bucket_bytes` (a bigger tensor gets its own).

    Example: sizes a=3, b=3, c=5, d=1 with bucket_bytes=6 -> [[a, b], [c, d]].
    """
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes: got {bucket_bytes}, expected >= 1")
    buckets: list[list[str]] = []
    size = 0
    for name, tensor in state.items():
        nbytes = tensor.numel() * tensor.element_size()
        if buckets and size + nbytes <= bucket_bytes:
            buckets[-1].append(name)
            size += nbytes
        else:
            buckets.append([name])
            size = nbytes
    return buckets


def write_version(publish_dir: str | Path, version: int, state: Mapping[str, torch.Tensor],
                  bucket_bytes: int = DEFAULT_BUCKET_BYTES, meta: dict[str, Any] | None = None,
                  keep: int = 2) -> PublishedDraft:
    """Write `state` (checkpoint names -> CPU tensors) as version `version`; returns its handle."""
    if version < 0:
        raise ValueError(f"version: got {version}, expected >= 0")
    if not state:
        raise ValueError("state: empty, expected the draft's tensors")
    root = Path(publish_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"v{version:06d}"
    if final.exists():
        raise FileExistsError(f"{final}: version {version} was already published (versions only increase)")
    newest = max(_versions(root), default=-1)
    if version <= newest:
        raise ValueError(f"version: got {version}, expected > {newest} (the newest version in {root}; "
                         "versions only increase)")
    tmp = Path(tempfile.mkdtemp(prefix=f".v{version:06d}.", dir=root))
    buckets = []
    total = 0
    for i, names in enumerate(plan_buckets(state, bucket_bytes)):
        tensors = {n: state[n].detach().to("cpu").contiguous() for n in names}
        file = f"bucket_{i:03d}.safetensors"
        save_file(tensors, str(tmp / file))
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        total += nbytes
        buckets.append({"file": file, "bytes": nbytes, "names": names})
    manifest = {"format": FORMAT, "version": version, "buckets": buckets, "total_bytes": total,
                "meta": meta or {}}
    (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1))
    os.replace(tmp, final)
    _prune(root, keep)
    return PublishedDraft(version=version, path=final, total_bytes=total, num_buckets=len(buckets))


def _versions(root: Path) -> list[int]:
    return sorted(int(p.name[1:]) for p in root.glob("v[0-9]*") if p.is_dir() and p.name[1:].isdigit())


def _prune(root: Path, keep: int) -> None:
    versions = _versions(root)
    for old in versions[:-keep] if keep > 0 else []:
        shutil.rmtree(root / f"v{old:06d}", ignore_errors=True)


def read_manifest(path: str | Path) -> dict[str, Any]:
    file = Path(path) / MANIFEST
    if not file.is_file():
        raise FileNotFoundError(f"{file}: no publish manifest (expected a directory written by write_version)")
    manifest: dict[str, Any] = json.loads(file.read_text())
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{file}: format {manifest.get('format')!r}, expected {FORMAT!r}")
    return manifest


def iter_buckets(path: str | Path) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Each bucket's (name, tensor) pairs, memory-mapped, in publish order."""
    manifest = read_manifest(path)
    for bucket in manifest["buckets"]:
        with safe_open(str(Path(path) / bucket["file"]), framework="pt") as f:
            found = sorted(f.keys())
            if found != sorted(bucket["names"]):
                raise ValueError(f"{path}/{bucket['file']}: tensors {found}, manifest says {sorted(bucket['names'])}")
            yield [(name, f.get_tensor(name)) for name in bucket["names"]]
