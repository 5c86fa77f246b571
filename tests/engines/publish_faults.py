"""Every way a published draft version can be torn, wrong or tampered with, applied to a real version
directory written by `write_version` (shared by the verifier's unit tests and the live-engine tests).

`CORRUPTIONS[name] = (corrupt(version_dir), reason code, message regex)`: the reason and message that
`verify_version` must refuse the damaged version with. Each needs at least 3 buckets with one of
more than one tensor (`write_version(..., bucket_bytes=...)` small enough).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from safetensors.torch import save_file

from verl_speco.online.publish import MANIFEST, bytes_checksum, load_version


def rewrite_manifest(path: Path, edit: Callable[[dict[str, Any]], Any]) -> None:
    manifest = json.loads((path / MANIFEST).read_text())
    edit(manifest)
    (path / MANIFEST).write_text(json.dumps(manifest))


def truncate(path: Path, index: int) -> None:
    file = sorted(path.glob("bucket_*.safetensors"))[index]
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])


def _flip_byte(path: Path) -> None:
    file = sorted(path.glob("bucket_*.safetensors"))[0]
    data = bytearray(file.read_bytes())
    data[-3] ^= 0x10  # inside the last tensor's data: the header still parses
    file.write_bytes(bytes(data))


def _drop_tensor(path: Path) -> None:
    """A bucket rewritten without one of its tensors, its size and checksum recorded anew (so only the
    name check can see it)."""
    manifest = json.loads((path / MANIFEST).read_text())
    bucket = next(b for b in manifest["buckets"] if len(b["names"]) > 1)
    tensors = load_version(path, manifest["version"])
    save_file({n: tensors[n] for n in bucket["names"][1:]}, str(path / bucket["file"]))
    data = (path / bucket["file"]).read_bytes()
    bucket["file_bytes"], bucket["checksum"] = len(data), bytes_checksum(data)
    (path / MANIFEST).write_text(json.dumps(manifest))


CORRUPTIONS = {
    "truncated first bucket": (lambda p: truncate(p, 0), "bucket", "truncated or torn"),
    "truncated last bucket": (lambda p: truncate(p, -1), "bucket", "truncated or torn"),
    "flipped byte": (_flip_byte, "checksum", "checksum s64x4k:"),
    "tensor missing from a bucket": (_drop_tensor, "tensors", "the manifest lists"),
    "missing bucket": (lambda p: sorted(p.glob("bucket_*"))[1].unlink(), "bucket", "bucket missing"),
    "manifest not JSON": (lambda p: (p / MANIFEST).write_text('{"format": "verl_speco.draft_pub'),
                          "manifest", "not a JSON manifest"),
    "no manifest": (lambda p: (p / MANIFEST).unlink(), "manifest", "no publish manifest"),
    "manifest lists a tensor no bucket has": (
        lambda p: rewrite_manifest(p, lambda m: m["buckets"][0]["names"].append("ghost")),
        "tensors", "the manifest lists"),
    "bucket entry without checksum": (lambda p: rewrite_manifest(p, lambda m: m["buckets"][0].pop("checksum")),
                                      "manifest", "buckets\\[0\\]"),
    "wrong format": (lambda p: rewrite_manifest(p, lambda m: m.update(format="verl_speco.draft_publish/1")),
                     "manifest", "expected 'verl_speco.draft_publish/2'"),
}


