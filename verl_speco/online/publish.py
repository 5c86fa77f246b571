"""Publishing draft weights as versioned, bucketed safetensors files (shared memory by default): a version
is `<publish_dir>/v000042/` (`manifest.json` + `bucket_NNN.safetensors`), written atomically, the `keep`
newest kept. Buckets bound a receiver's memory; tensors never travel pickled. Receivers never trust a
version: `verify_version` checks it completely before an engine is touched."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load as load_safetensors
from safetensors.torch import save_file

from feature_store.checksum import SectorSumHasher

FORMAT = "verl_speco.draft_publish/2"
MANIFEST = "manifest.json"
DEFAULT_BUCKET_BYTES = 256 << 20
KEEP = 2  # published versions kept on disk (`write_version` prunes the older ones)


def publish_dir_of(publish_dir: str | None, run_name: str) -> Path:
    """Where a run publishes: `drafter.publish_dir` when set, else `default_publish_dir(run_name)`."""
    return Path(publish_dir) if publish_dir else default_publish_dir(run_name)


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
    """Group names in order into buckets of at most `bucket_bytes` (a bigger tensor gets its own)."""
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
                  keep: int = KEEP) -> PublishedDraft:
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
        data = (tmp / file).read_bytes()
        buckets.append({"file": file, "bytes": nbytes, "file_bytes": len(data), "checksum": bytes_checksum(data),
                        "names": names})
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


def bytes_checksum(data: bytes) -> str:
    """The Feature Store's ``s64x4k`` checksum of a bucket file's bytes (several GB/s)."""
    hasher = SectorSumHasher()
    hasher.update(data)
    return hasher.hexdigest()


TensorSpec = tuple[tuple[int, ...], str]  # (shape, dtype name as torch prints it without "torch.")


def tensor_spec(tensor: torch.Tensor) -> TensorSpec:
    return tuple(int(d) for d in tensor.shape), str(tensor.dtype).removeprefix("torch.")


_SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
                       "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
                       "BOOL": "bool"}


def checkpoint_spec(checkpoint_dir: str | Path) -> dict[str, TensorSpec]:
    """Names, shapes and dtypes of the tensors in a checkpoint directory's `*.safetensors` files,
    read from the headers only (what an engine loaded its draft from at start-up)."""
    files = sorted(Path(checkpoint_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{checkpoint_dir}: no *.safetensors files (expected a draft checkpoint)")
    spec: dict[str, TensorSpec] = {}
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                sl = f.get_slice(name)
                dtype = sl.get_dtype()
                spec[name] = (tuple(int(d) for d in sl.get_shape()), _SAFETENSORS_DTYPES.get(dtype, dtype))
    return spec


class PublishRejected(ValueError):
    """A published version that must not reach an engine; `reason` is a short code for metrics
    (manifest, version, bucket, checksum, tensors, spec, non_finite), the message says what and where."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason


def _manifest_file(path: Path) -> dict[str, Any]:
    file = path / MANIFEST
    if not file.is_file():
        raise PublishRejected("manifest", f"{file}: no publish manifest (expected a directory written by "
                                          "write_version)")
    try:
        manifest = json.loads(file.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PublishRejected("manifest", f"{file}: not a JSON manifest ({e})") from None
    if not isinstance(manifest, dict):
        raise PublishRejected("manifest", f"{file}: got a JSON {type(manifest).__name__}, expected an object")
    if manifest.get("format") != FORMAT:
        raise PublishRejected("manifest", f"{file}: format {manifest.get('format')!r}, expected {FORMAT!r}")
    buckets = manifest.get("buckets")
    if not isinstance(buckets, list) or not buckets:
        raise PublishRejected("manifest", f"{file}: buckets {buckets!r}, expected a non-empty list")
    for i, b in enumerate(buckets):
        ok = (isinstance(b, dict) and isinstance(b.get("file"), str) and isinstance(b.get("checksum"), str)
              and isinstance(b.get("file_bytes"), int) and isinstance(b.get("names"), list)
              and all(isinstance(n, str) for n in b["names"]) and "/" not in b["file"])
        if not ok:
            raise PublishRejected("manifest", f"{file}: buckets[{i}] = {b!r}, expected {{file, file_bytes, "
                                              "checksum, names}} with a plain file name")
    return manifest


def read_manifest(path: str | Path) -> dict[str, Any]:
    """The parsed manifest of a version directory (structure checked; `PublishRejected` otherwise)."""
    return _manifest_file(Path(path))


def _bucket_bytes(path: Path, bucket: dict[str, Any]) -> bytes:
    file = path / bucket["file"]
    try:
        data = file.read_bytes()
    except FileNotFoundError:
        raise PublishRejected("bucket", f"{file}: bucket missing (listed in the manifest)") from None
    if len(data) != bucket["file_bytes"]:
        raise PublishRejected("bucket", f"{file}: {len(data)} bytes, the manifest records {bucket['file_bytes']} "
                                        "(truncated or torn)")
    got = bytes_checksum(data)
    if got != bucket["checksum"]:
        raise PublishRejected("checksum", f"{file}: checksum {got}, the manifest records {bucket['checksum']}")
    return data


def _bucket_tensors(path: Path, bucket: dict[str, Any], data: bytes) -> dict[str, torch.Tensor]:
    try:
        tensors = load_safetensors(data)
    except Exception as e:  # safetensors raises its own error types for a bad header
        raise PublishRejected("bucket", f"{path / bucket['file']}: not a safetensors file ({e})") from None
    if sorted(tensors) != sorted(bucket["names"]):
        raise PublishRejected("tensors", f"{path / bucket['file']}: tensors {sorted(tensors)}, the manifest "
                                         f"lists {sorted(bucket['names'])}")
    return tensors


def verify_version(path: str | Path, version: int,
                   expected: Mapping[str, TensorSpec] | None = None) -> dict[str, Any]:
    """Check a published version completely, touching nothing; its manifest, or `PublishRejected`.
    `expected`: the live draft's checkpoint names -> (shape, dtype); the version must hold exactly these."""
    path = Path(path)
    manifest = _manifest_file(path)
    if manifest.get("version") != int(version) or path.name != f"v{int(version):06d}":
        raise PublishRejected("version", f"{path}: offered as version {version}, but the manifest says "
                                         f"{manifest.get('version')!r} and the directory is {path.name!r} "
                                         f"(expected v{int(version):06d} holding version {version})")
    seen: dict[str, TensorSpec] = {}
    for bucket in manifest["buckets"]:
        tensors = _bucket_tensors(path, bucket, _bucket_bytes(path, bucket))
        for name, tensor in tensors.items():
            if name in seen:
                raise PublishRejected("tensors", f"{path / bucket['file']}: {name} appears in two buckets")
            seen[name] = tensor_spec(tensor)
            if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
                bad = int((~torch.isfinite(tensor)).sum())
                raise PublishRejected("non_finite", f"{path / bucket['file']}: {name} has {bad} non-finite "
                                                    f"values of {tensor.numel()}")
    if expected is not None:
        missing, extra = sorted(set(expected) - set(seen)), sorted(set(seen) - set(expected))
        if missing or extra:
            raise PublishRejected("spec", f"{path}: tensors missing {missing}, unexpected {extra} "
                                          "(expected exactly the live draft's)")
        wrong = [f"{n}: {seen[n]}, expected {tuple(expected[n])}" for n in sorted(seen)
                 if seen[n] != (tuple(expected[n][0]), expected[n][1])]
        if wrong:
            raise PublishRejected("spec", f"{path}: (shape, dtype) differ from the live draft's: " + "; ".join(wrong))
    return manifest


def verified_buckets(path: str | Path, manifest: dict[str, Any]) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Each bucket's (name, tensor) pairs in publish order, from bytes whose size and checksum are
    checked again (what `verify_version` accepted); `PublishRejected` if a file changed since."""
    path = Path(path)
    for bucket in manifest["buckets"]:
        tensors = _bucket_tensors(path, bucket, _bucket_bytes(path, bucket))
        yield [(name, tensors[name]) for name in bucket["names"]]


def load_version(path: str | Path, version: int,
                 expected: Mapping[str, TensorSpec] | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of a verified version (`verify_version`, then `verified_buckets`), in publish order."""
    manifest = verify_version(path, version, expected)
    return {name: tensor for bucket in verified_buckets(path, manifest) for name, tensor in bucket}


LOAD_STATUSES = ("loaded", "stale", "rejected", "failed")


def stale_reason(version: int, held: int | None) -> str | None:
    """The forward-only gate of every engine: why `version` must be dropped when `held` is served (None:
    it may load; anything loads while nothing is held)."""
    if held is not None and held >= 0 and int(version) <= int(held):
        return f"version {version} <= the loaded version {held}"
    return None


def load_outcome(answers: Sequence[Mapping[str, Any]]) -> tuple[str, list[str]]:
    """One status for every engine worker's answer to a load (`loaded` only when all loaded, else the
    first of rejected, failed, stale) and their distinct reasons."""
    if not answers:
        return "failed", ["no engine worker answered"]
    statuses = [str(a.get("status")) for a in answers]
    unknown = sorted(set(statuses) - set(LOAD_STATUSES))
    if unknown:
        raise ValueError(f"answers: statuses {unknown}, expected one of {LOAD_STATUSES}")
    reasons = list(dict.fromkeys(str(a.get("reason", "")) for a in answers if a.get("status") != "loaded"))
    for status in ("rejected", "failed", "stale"):
        if status in statuses:
            return status, reasons
    return "loaded", []
