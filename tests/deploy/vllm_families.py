"""What each drafter family hands vLLM, taken from the family code itself, and what a vLLM tree lacks of it.

`tiny_exports(workdir, engine)` builds a tiny untrained draft of every catalog family that has a
method for the engine and exports it through its engine format. `family_vllm_specs(workdir)`
records what each format writes for vLLM: the speculative config (`method` and every key) and the
export's `architectures`. `family_gaps(tree, specs)` says, per family, what a vLLM source tree
(`VllmTree`) lacks to serve it: the method among `SpeculativeConfig.method`'s values, each key
among its fields, one of the architectures in its speculative model registry.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deploy.vllm_tree import VllmTree

MAX_K = 64  # the first num_speculative_tokens in 1..MAX_K a family's format accepts is used


@dataclass(frozen=True)
class FamilyVllmSpec:
    family: str
    method: str
    keys: tuple[str, ...]  # every speculative_config key the family's format writes
    architectures: tuple[str, ...]  # config.json "architectures" of its export


def _tiny_spec() -> Any:
    from drafters.common.target import TargetSpec

    return TargetSpec(vocab_size=37, hidden_size=32, num_hidden_layers=8, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=8, intermediate_size=64, rope_theta=10000.0,
                      rms_norm_eps=1e-6, max_position_embeddings=128, model_type="qwen3",
                      tie_word_embeddings=False)


def _speculative_config(fmt: Any, draft_dir: Path) -> dict[str, Any]:
    errors: list[str] = []
    for k in range(1, MAX_K + 1):
        try:
            config: dict[str, Any] = fmt.vllm_speculative_config(draft_dir, k)
            return config
        except ValueError as err:
            errors.append(str(err))
    raise ValueError(f"{fmt.family}: its format accepts no num_speculative_tokens in 1..{MAX_K} "
                     f"(first refusal: {errors[0]})")


def tiny_exports(workdir: str | Path, engine: str) -> dict[str, tuple[Any, Path]]:
    """family -> (engine format, export directory) of a tiny untrained draft, for every catalog family
    with a method for `engine`, exported through its own format under `workdir`."""
    import torch

    from drafters.common.contract import StoreStats
    from drafters.common.target import TargetHead
    from drafters.registry import CATALOG, get_family

    spec = _tiny_spec()
    gen = torch.Generator().manual_seed(0)
    head = TargetHead(spec, torch.randn(spec.vocab_size, spec.hidden_size, generator=gen),
                      torch.randn(spec.vocab_size, spec.hidden_size, generator=gen), torch.ones(spec.hidden_size))
    out: dict[str, tuple[Any, Path]] = {}
    for name, entry in CATALOG.items():
        if not any(m.engine == engine for m in entry.engine_methods):
            continue
        family = get_family(name)
        cfg = family.config_cls()
        fields = {f.name for f in dataclasses.fields(cfg)}
        settings = {"mask_token_id": spec.vocab_size - 1} if "mask_token_id" in fields else {}
        cfg = family.resolve(dataclasses.replace(cfg, **settings), spec)
        fmt = family.engine_format(cfg, spec)
        model = family.build(cfg, head, StoreStats(torch.ones(spec.vocab_size, dtype=torch.int64)))
        directory = Path(workdir) / engine / name
        fmt.export(model.state_dict(), directory)
        out[name] = (fmt, directory)
    return out


def family_vllm_specs(workdir: str | Path) -> dict[str, FamilyVllmSpec]:
    """Per catalog family with a vLLM method: what its format writes for vLLM (exports under `workdir`)."""
    specs: dict[str, FamilyVllmSpec] = {}
    for name, (fmt, directory) in tiny_exports(workdir, "vllm").items():
        architectures = json.loads((directory / "config.json").read_text()).get("architectures") or []
        config = _speculative_config(fmt, directory)
        specs[name] = FamilyVllmSpec(name, str(config["method"]), tuple(sorted(config)), tuple(architectures))
    return specs


def family_gaps(tree: VllmTree, specs: dict[str, FamilyVllmSpec]) -> dict[str, list[str]]:
    """family -> what `tree` lacks to serve it (families it lacks nothing of are left out)."""
    methods = tree.speculative_methods()
    fields = tree.speculative_config_fields()
    registered = tree.speculative_architectures()
    gaps: dict[str, list[str]] = {}
    for name, spec in specs.items():
        lacks = [] if spec.method in methods else [f"speculative method {spec.method!r}"]
        lacks += [f"SpeculativeConfig field {key!r}" for key in spec.keys if key not in fields]
        if not set(spec.architectures) & registered:
            lacks.append(f"a speculative model for architectures {list(spec.architectures)}")
        if lacks:
            gaps[name] = lacks
    return gaps
