"""The pip constraints an engine image installs verl-speco under: the image keeps its own engine stack.

The GPU and Ascend Dockerfiles run `python3 -m verl_speco.deploy.image_constraints <line> --out
/opt/image-constraints.txt` and pass `-c` with it to every install (tests/deploy/test_dockerfiles.py),
so no dependency can replace the image's torch, torch-npu, vLLM, vllm-ascend, SGLang, triton or
transformers: each distribution of `ENGINE_STACK` the image holds is pinned at its installed version,
local label included. The image is first checked against its versions.toml line (every pin but verl,
which the Dockerfile installs); a difference stops the build naming the package and both versions."""

from __future__ import annotations

import argparse
import importlib.metadata
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from verl_speco.deploy.versions import DISTRIBUTIONS, Versions, base_version, load_versions

# what an engine image brings and our install must never replace (absent ones are skipped)
ENGINE_STACK = ("torch", "torch-npu", "torchvision", "torchaudio", "triton", "vllm", "vllm-ascend", "sglang",
                "sgl-kernel", "flashinfer-python", "xformers", "transformers")
INSTALLED_BY_DOCKERFILE = ("verl",)  # line keys the Dockerfile installs itself (pinned, not checked)


class ImageDriftError(ValueError):
    """The image's installed engine stack differs from its line in versions.toml."""


def canonical(name: str) -> str:
    """PEP 503 name: "torch_npu" -> "torch-npu"."""
    return re.sub(r"[-_.]+", "-", name).lower()


def installed_versions() -> dict[str, str]:
    """Canonical distribution name -> version, for this interpreter's installed distributions."""
    out: dict[str, str] = {}
    for dist in importlib.metadata.distributions():
        name = dist.metadata["Name"]
        if name:
            out.setdefault(canonical(name), dist.version)
    return out


def image_constraints(line_name: str, installed: Mapping[str, str], versions: Versions | None = None) -> list[str]:
    """The constraint lines (`dist==version`, sorted) for an image of `line_name` holding `installed`
    (canonical name -> version); raises `ImageDriftError` listing every package that differs."""
    v = versions or load_versions()
    line = v.line(line_name)
    have = {canonical(k): ver for k, ver in installed.items()}
    pins: dict[str, str] = {}
    drift = []
    for key, dist in DISTRIBUTIONS.items():
        if key not in line:
            continue
        if key in INSTALLED_BY_DOCKERFILE:
            pins[dist] = line[key]
        elif dist not in have:
            drift.append(f"{dist}: not installed in the image, line {line_name} pins {line[key]}")
        elif base_version(have[dist]) != line[key]:
            drift.append(f"{dist}: the image has {have[dist]}, line {line_name} pins {line[key]}")
        else:
            pins[dist] = have[dist]
    if drift:
        raise ImageDriftError(f"the image differs from line {line_name} of {v.source}: " + "; ".join(drift)
                              + " (build FROM the line's base_image, or update the line)")
    pins.update({dist: have[dist] for dist in ENGINE_STACK if dist in have})
    return sorted(f"{dist}=={version}" for dist, version in pins.items())


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m verl_speco.deploy.image_constraints",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("line", help="the image's deployment line in versions.toml, e.g. gpu-vllm")
    p.add_argument("--out", default=None, help="write the constraints here (default: print them)")
    args = p.parse_args(argv)
    try:
        lines = image_constraints(args.line, installed_versions())
    except ValueError as e:  # ImageDriftError, VersionsError (an unknown line)
        print(f"image_constraints: error: {e}", file=sys.stderr)
        return 2
    text = "".join(f"{line}\n" for line in lines)
    if args.out is None:
        sys.stdout.write(text)
    else:
        Path(args.out).write_text(text)
        print(f"image_constraints: {len(lines)} pins for line {args.line} -> {args.out}: {', '.join(lines)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
