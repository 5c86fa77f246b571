"""An engine release's Python source for the source checks: `pip download --no-deps` of its wheel,
the `.py` files unpacked into a cache directory off sys.path (read with `ast`, never imported).

Like the references scripts/setup_env.sh installs with `--no-deps --target` (vLLM 0.24.0, SGLang),
but fetched by the test itself and kept between runs under VERL_SPECO_ENGINE_SRC_CACHE (default:
<tmp>/verl_speco_engine_src/<distribution>-<version>). Skips only when the download is impossible
(no index reachable), saying so; a download that succeeds but holds no package fails.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import pytest


def cache_root() -> Path:
    return Path(os.environ.get("VERL_SPECO_ENGINE_SRC_CACHE") or Path(tempfile.gettempdir()) / "verl_speco_engine_src")


def wheel_source(distribution: str, version: str, package: str) -> Path:
    """The directory holding `package` (e.g. "vllm_ascend") of `distribution==version`'s wheel."""
    dest = cache_root() / f"{distribution}-{version}"
    done = dest / ".complete"
    if done.is_file():
        return dest
    wheels = dest / "wheel"
    wheels.mkdir(parents=True, exist_ok=True)
    got = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                          "--quiet", "-d", str(wheels), f"{distribution}=={version}"],
                         capture_output=True, text=True, timeout=900)
    found = sorted(wheels.glob("*.whl"))
    if got.returncode != 0 or not found:
        pytest.skip(f"cannot download {distribution}=={version} (pip download --no-deps failed: "
                    f"{(got.stderr.strip().splitlines() or ['no output'])[-1]})")
    with zipfile.ZipFile(found[0]) as wheel:
        members = [m for m in wheel.namelist() if m.startswith(f"{package}/") and m.endswith(".py")]
        assert members, f"{found[0].name}: no {package}/*.py inside"
        wheel.extractall(dest, members)
    for whl in found:
        whl.unlink()  # only the sources are kept
    done.write_text(f"{distribution}=={version}\n")
    return dest
