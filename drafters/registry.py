"""The catalog: the one place a drafter family is registered (docs/design/architecture.md section 2).
Families load lazily by import path; a built-in is one `CatalogEntry` in `BUILTIN`, another package's
registers through the entry-point group `ENTRY_POINT_GROUP` or `register_family` (docs/adding-a-family.md);
`get_family` refuses a family lacking a contract member (`FamilyContractError`)."""

from __future__ import annotations

import importlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from pathlib import Path
from types import MappingProxyType
from typing import Any

from drafters.common.contract import EXPORT_META_FILE, DrafterFamily, EngineFormat, contract_gaps

ENGINES = ("vllm", "sglang")
ENTRY_POINT_GROUP = "verl_speco_drafters"
NAME_PATTERN = r"[a-z][a-z0-9_]*"  # a family name: also a config value, a directory and a preset name


class RegistryError(LookupError):
    """Base class of catalog lookup errors."""


class UnknownFamilyError(RegistryError):
    """The name is not in the catalog."""


class UnknownEngineMethodError(RegistryError):
    """The family has no known method for that engine."""


class FamilyContractError(RegistryError):
    """The family object lacks members of the family contract (drafters/common/contract.py)."""


@dataclass(frozen=True)
class EngineMethod:
    engine: str
    method: str
    extra: Mapping[str, Any] = field(default_factory=dict)
    note: str = ""
    serves_as: str = ""  # what the engine runs when it is not the family's own drafting (a few words)

    def label(self) -> str:
        """The method in a few words, for tables: "eagle3 + parallel_drafting", "eagle, EAGLE-1 chain"."""
        flags = "".join(f" + {key}" for key, value in self.extra.items() if value is True)
        return self.method + flags + (f", {self.serves_as}" if self.serves_as else "")


@dataclass(frozen=True)
class CatalogEntry:
    """import_path: "module:attribute" of the family object. draft_depth: the config field fixing k
    drafts per round and its offset (`field = k + offset`), None when k is a decoding choice.
    trains_as: the family whose weights and training step this one uses (EAGLE-2: EAGLE-1's)."""

    name: str
    summary: str
    import_path: str
    engine_methods: tuple[EngineMethod, ...]
    draft_depth: tuple[str, int] | None = None
    trains_as: str | None = None


def _m(engine: str, method: str, note: str = "", serves_as: str = "", **extra: Any) -> EngineMethod:
    return EngineMethod(engine, method, MappingProxyType(dict(extra)), note, serves_as)


BUILTIN: Mapping[str, CatalogEntry] = MappingProxyType({e.name: e for e in (
    CatalogEntry("eagle1", "EAGLE-1: feature-level autoregressive draft over the target's last hidden state",
                 "drafters.eagle1.family:FAMILY",
                 (_m("vllm", "eagle"), _m("sglang", "EAGLE"))),
    CatalogEntry("eagle2", "EAGLE-2: EAGLE-1 weights with dynamic-tree drafting",
                 "drafters.eagle2.family:FAMILY",
                 (_m("vllm", "eagle", note="vLLM 0.32 has no tree: it serves the EAGLE-1 chain; the dynamic "
                                           "tree is not realised", serves_as="EAGLE-1 chain"),
                  _m("sglang", "EAGLE", note="dynamic tree: --speculative-eagle-topk = top_k > 1, --speculative-"
                                             "num-steps = depth, --speculative-num-draft-tokens = total_tokens + 1")),
                 trains_as="eagle1"),
    CatalogEntry("eagle3", "EAGLE-3: fused multi-layer target features, training-time test, draft vocab",
                 "drafters.eagle3.family:FAMILY",
                 (_m("vllm", "eagle3"), _m("sglang", "EAGLE3"))),
    CatalogEntry("dflash", "DFlash: block-diffusion drafter over injected target context",
                 "drafters.dflash.family:FAMILY",
                 (_m("vllm", "dflash", note="num_speculative_tokens = block_size - 1"),
                  _m("sglang", "DFLASH", note="--speculative-num-draft-tokens = block_size")),
                 draft_depth=("block_size", 1)),
    CatalogEntry("dspark", "DSpark: DFlash backbone + Markov head + confidence head",
                 "drafters.dspark.family:FAMILY",
                 (_m("vllm", "dspark", note="num_speculative_tokens = block_size; V2 runner only (GPU), vanilla "
                                            "Markov head only"),
                  _m("sglang", "DSPARK", note="--speculative-dspark-block-size = block_size; CUDA/NPU/XPU")),
                 draft_depth=("block_size", 0)),
    CatalogEntry("domino", "Domino: DFlash backbone + causal GRU correction head",
                 "drafters.domino.family:FAMILY",
                 (_m("sglang", "DFLASH", note="dflash_config.projector_type domino; --speculative-num-draft-tokens = "
                                              "block_size; greedy, CUDA, bf16, full vocab"),),
                 draft_depth=("block_size", 1)),
    CatalogEntry("peagle", "P-EAGLE: EAGLE-3 with parallel drafting of K tokens in one pass",
                 "drafters.peagle.family:FAMILY",
                 (_m("vllm", "eagle3", note="vLLM >= 0.16; num_speculative_tokens <= the trained depths; SGLang "
                                            "0.5.23 has no P-EAGLE", parallel_drafting=True),),
                 draft_depth=("num_depths", 0)),
)})


_ENTRIES: dict[str, CatalogEntry] = dict(BUILTIN)
CATALOG: Mapping[str, CatalogEntry] = MappingProxyType(_ENTRIES)  # live: built-ins, then registered families
_CHECKED: dict[str, DrafterFamily] = {}  # families that passed the contract check
_BROKEN: dict[str, str] = {}  # entry-point name -> why it could not be loaded
_discovered = False


def register_family(entry: CatalogEntry) -> None:
    """Add a family from another package to the catalog (idempotent); a different entry under a known name,
    a malformed name or an unknown engine is refused naming it."""
    if not isinstance(entry, CatalogEntry):
        raise TypeError(f"register_family: got {type(entry).__name__}, expected a drafters.registry.CatalogEntry")
    if not re.fullmatch(NAME_PATTERN, entry.name):
        raise ValueError(f"register_family: name {entry.name!r}, expected lower-case letters, digits and _ "
                         f"({NAME_PATTERN})")
    module, sep, attr = entry.import_path.partition(":")
    if not (module and sep and attr):
        raise ValueError(f"register_family {entry.name!r}: import_path {entry.import_path!r}, expected "
                         "'package.module:ATTRIBUTE'")
    engines = [m.engine for m in entry.engine_methods if m.engine not in ENGINES]
    if engines:
        raise ValueError(f"register_family {entry.name!r}: engines {engines}, expected some of {ENGINES}")
    if entry.trains_as is not None and (entry.trains_as not in _ENTRIES or _ENTRIES[entry.trains_as].trains_as):
        raise ValueError(f"register_family {entry.name!r}: trains_as {entry.trains_as!r}, expected a known family "
                         "with a training step of its own, or None")
    have = _ENTRIES.get(entry.name)
    if have is not None and have != entry:
        where = "a built-in family" if entry.name in BUILTIN else f"registered from {have.import_path}"
        raise ValueError(f"register_family: {entry.name!r} is already {where}")
    _ENTRIES[entry.name] = entry
    _BROKEN.pop(entry.name, None)


def unregister_family(name: str) -> None:
    """Remove a family added by `register_family` or an entry point (built-ins cannot be removed)."""
    if name in BUILTIN:
        raise ValueError(f"unregister_family: {name!r} is a built-in family")
    if name not in _ENTRIES:
        raise UnknownFamilyError(f"unregister_family: {name!r} is not registered")
    del _ENTRIES[name]
    _CHECKED.pop(name, None)


def discover_families() -> tuple[str, ...]:
    """Register every family installed packages declare under `ENTRY_POINT_GROUP`; returns the names found.
    One that fails to load is remembered, and a lookup of its name reports the error."""
    global _discovered
    _discovered = True
    found = []
    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            entry = ep.load()
            if not isinstance(entry, CatalogEntry) or entry.name != ep.name:
                raise ValueError(f"{ep.value} is {entry!r}, expected a CatalogEntry named {ep.name!r}")
            if _ENTRIES.get(ep.name) != entry:
                register_family(entry)
            found.append(ep.name)
        except Exception as err:  # noqa: BLE001 (a broken plugin must not break the built-in families)
            _BROKEN[ep.name] = f"entry point {ep.name} = {ep.value} ({ENTRY_POINT_GROUP}): {type(err).__name__}: {err}"
    return tuple(found)


def _catalog() -> Mapping[str, CatalogEntry]:
    if not _discovered:
        discover_families()
    return CATALOG


def training_families() -> tuple[str, ...]:
    """The known families with a training step of their own (`CatalogEntry.trains_as` is None)."""
    return tuple(n for n, e in _catalog().items() if e.trains_as is None)


def known_families() -> tuple[str, ...]:
    """Every catalog name, in catalog order (built-ins first, then registered families)."""
    return tuple(_catalog())


def available_families() -> tuple[str, ...]:
    """The families this version implements: every catalog entry (all seven built-ins are implemented)."""
    return known_families()


def catalog_entry(name: str) -> CatalogEntry:
    if name not in _catalog():
        discover_families()  # a package installed (or put on sys.path) since the last look
    if name not in CATALOG:
        why = f" ({_BROKEN[name]})" if name in _BROKEN else ""
        raise UnknownFamilyError(f"unknown drafter family {name!r}{why}; valid names: {', '.join(CATALOG)}")
    return CATALOG[name]


def get_family(name: str) -> DrafterFamily:
    """The family object for `name` (imported on first use, then checked against the contract:
    `FamilyContractError` names every member it lacks)."""
    entry = catalog_entry(name)
    checked = _CHECKED.get(name)
    if checked is not None:
        return checked
    module_name, attr = entry.import_path.split(":")
    family: DrafterFamily = getattr(importlib.import_module(module_name), attr)
    gaps = contract_gaps(family)
    if gaps:
        raise FamilyContractError(f"drafter family {name!r} ({entry.import_path}) does not implement the family "
                                  f"contract: missing {gaps} (drafters/common/contract.py DrafterFamily and "
                                  "drafters/common/family_base.py HOOKS; docs/adding-a-family.md)")
    if getattr(family, "name", name) != name:
        raise FamilyContractError(f"drafter family {name!r} ({entry.import_path}): the object's name is "
                                  f"{family.name!r}, expected {name!r}")
    _CHECKED[name] = family
    return family


def engine_method(name: str, engine: str) -> EngineMethod:
    """How `engine` ("vllm" or "sglang") names the speculative method of family `name`."""
    if engine not in ENGINES:
        raise UnknownEngineMethodError(f"engine: got {engine!r}, expected one of {ENGINES}")
    for m in catalog_entry(name).engine_methods:
        if m.engine == engine:
            return m
    raise UnknownEngineMethodError(f"drafter family {name!r} has no known {engine} method "
                                   f"(engines with one: {[m.engine for m in catalog_entry(name).engine_methods]})")


def has_engine_method(name: str, engine: str) -> bool:
    """Whether the catalog knows a method of `engine` for family `name`."""
    return any(m.engine == engine for m in catalog_entry(name).engine_methods)


def draft_depth_settings(name: str, k: int) -> dict[str, int]:
    """The config settings that make family `name` draft `k` tokens per round (`CatalogEntry.draft_depth`):
    {"block_size": k + 1} for DFlash, {} where k is a decoding choice (chains, trees)."""
    depth = catalog_entry(name).draft_depth
    return {} if depth is None else {depth[0]: k + depth[1]}


def engine_format_from_dict(data: Mapping[str, Any]) -> EngineFormat:
    """Rebuild a family's engine format from its `to_dict()` (e.g. a publish manifest's meta)."""
    name = data.get("family")
    if not isinstance(name, str):
        raise ValueError(f"engine format: family {name!r}, expected a family name ({', '.join(available_families())})")
    return get_family(name).format_from_dict(data)


def export_family(export_dir: str | Path) -> str:
    """The family that wrote an export directory (its `verl_speco_meta.json`)."""
    meta = Path(export_dir) / EXPORT_META_FILE
    if not meta.is_file():
        raise FileNotFoundError(f"{meta}: missing; expected an export written by verl-speco (its family is "
                                "recorded there)")
    family = json.loads(meta.read_text()).get("family")
    if not isinstance(family, str):
        raise ValueError(f"{meta}: family {family!r}, expected one of {', '.join(known_families())}")
    catalog_entry(family)
    return family


def vllm_methods() -> tuple[str, ...]:
    """Every vLLM speculative method the catalog uses, plus the target-free ones (ngram, draft_model)."""
    names = {m.method for e in _catalog().values() for m in e.engine_methods if m.engine == "vllm"}
    return tuple(sorted(names | {"ngram", "draft_model"}))
