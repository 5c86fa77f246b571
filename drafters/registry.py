"""The catalog: the one place a drafter family is registered (docs/design/architecture.md section 2).

Families load lazily by import path, so `import drafters.registry` imports no family code.
Engine method names (vLLM `speculative_config["method"]`, SGLang `--speculative-algorithm`)
are catalog data (docs/design/algorithms.md sections 1-7; docs/design/engines.md for what each engine serves).
"""

from __future__ import annotations

import importlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any

from drafters.common.contract import EXPORT_META_FILE, DrafterFamily, EngineFormat

ENGINES = ("vllm", "sglang")


class RegistryError(LookupError):
    """Base class of catalog lookup errors."""


class UnknownFamilyError(RegistryError):
    """The name is not in the catalog."""


class UnknownEngineMethodError(RegistryError):
    """The family has no known method for that engine."""


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
    """import_path: "module:attribute" of the family object. draft_depth: the config field that
    fixes how many tokens one round drafts, and its offset: k drafts per round need `field = k +
    offset` (a block drafter's block_size, P-EAGLE's num_depths); None: k is a decoding choice."""

    name: str
    summary: str
    import_path: str
    engine_methods: tuple[EngineMethod, ...]
    draft_depth: tuple[str, int] | None = None


def _m(engine: str, method: str, note: str = "", serves_as: str = "", **extra: Any) -> EngineMethod:
    return EngineMethod(engine, method, MappingProxyType(dict(extra)), note, serves_as)


CATALOG: Mapping[str, CatalogEntry] = MappingProxyType({e.name: e for e in (
    CatalogEntry("eagle1", "EAGLE-1: feature-level autoregressive draft over the target's last hidden state",
                 "drafters.eagle1.family:FAMILY",
                 (_m("vllm", "eagle"), _m("sglang", "EAGLE"))),
    CatalogEntry("eagle2", "EAGLE-2: EAGLE-1 weights with dynamic-tree drafting",
                 "drafters.eagle2.family:FAMILY",
                 (_m("vllm", "eagle", note="vLLM 0.32 has no tree: it serves the EAGLE-1 chain; the dynamic "
                                           "tree is not realised", serves_as="EAGLE-1 chain"),
                  _m("sglang", "EAGLE", note="dynamic tree: --speculative-eagle-topk = top_k > 1, --speculative-"
                                             "num-steps = depth, --speculative-num-draft-tokens = total_tokens + 1"))),
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


def known_families() -> tuple[str, ...]:
    """Every catalog name, in catalog order."""
    return tuple(CATALOG)


def available_families() -> tuple[str, ...]:
    """The families this version implements: every catalog entry (all seven are implemented)."""
    return known_families()


def catalog_entry(name: str) -> CatalogEntry:
    if name not in CATALOG:
        raise UnknownFamilyError(f"unknown drafter family {name!r}; valid names: {', '.join(CATALOG)}")
    return CATALOG[name]


def get_family(name: str) -> DrafterFamily:
    """The family object for `name` (imported on first use)."""
    entry = catalog_entry(name)
    module_name, attr = entry.import_path.split(":")
    family: DrafterFamily = getattr(importlib.import_module(module_name), attr)
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
    names = {m.method for e in CATALOG.values() for m in e.engine_methods if m.engine == "vllm"}
    return tuple(sorted(names | {"ngram", "draft_model"}))
