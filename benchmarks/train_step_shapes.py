"""Shape presets of scripts/bench_train_step.py: `--shapes qwen3-8b` read from the recipe catalog.

Every value comes from one place in the repository, named in its `source`:
- target sizes: `verl_speco.launchers.recipes.QWEN3_8B` (hidden, heads, kv heads, intermediate, vocab);
- family settings: `recipes.drafter_recipe(family, "gpu")` (the published Qwen3-8B recipes, `recipes.gpu`
  of configs/drafter/<family>.yaml), the rest from the family's config class defaults
  (`recipes.family_config`: DFlashConfig.num_anchors, loss_gamma,
  num_target_features; DSparkConfig.markov_rank; PEagleConfig.cod_ratio, cod_ratio_min);
- sequence length: `data.max_seq_len` of the family's Qwen3-8B trainer preset
  (`configs/preset/qwen3_8b_<family>.yaml`) where there is one, else the trainer's default
  (`verl_speco.train.config.DataSection.max_seq_len`);
- compute dtype: `run.mixed_precision` of configs/preset/qwen3_8b_eagle3.yaml (bf16 autocast, the one
  Qwen3-8B preset), for every family.

`CPU_FIT` lists the reductions for a 24 GiB, 2-core CPU machine (each with its reason); the script
prints them. They apply unless `--no-cpu-fit`; a flag given explicitly wins over both.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from verl_speco.launchers import recipes

SHAPES = ("default", "qwen3-8b")
MEMORY_GOALS = {"eagle3": 0.8, "peagle": 0.8, "dflash": 0.5, "dspark": 0.5, "domino": 0.5}
NOT_IN_SPECULATORS = {"domino": "speculators 0.9.0 has no Domino drafter: no reference to measure against "
                                "(memory goal <= 0.5x)"}
DTYPE_PRESET = "qwen3_8b_eagle3"

# bench arg <- (family config attribute) per family
FAMILY_FIELDS: dict[str, dict[str, str]] = {
    "eagle3": {"draft_vocab": "draft_vocab_size", "ttt_steps": "ttt_steps", "ttt_decay": "ttt_decay"},
    "peagle": {"draft_vocab": "draft_vocab_size", "peagle_layers": "num_layers", "num_depths": "num_depths",
               "cod_ratio": "cod_ratio", "cod_ratio_min": "cod_ratio_min"},
    "dflash": {"layers": "num_layers", "block_size": "block_size", "loss_gamma": "loss_gamma",
               "num_anchors": "num_anchors", "context_layers": "num_target_features"},
    "dspark": {"layers": "num_layers", "block_size": "block_size", "loss_gamma": "loss_gamma",
               "num_anchors": "num_anchors", "context_layers": "num_target_features", "markov_rank": "markov_rank"},
}


@dataclass(frozen=True)
class Reduction:
    """One CPU-fit change against the recipe: `arg` set to `value` for `families`, and why."""

    arg: str
    families: tuple[str, ...]
    value: Any  # an int, or "scaled" (num_anchors: the recipe's anchors per token at the reduced length)
    why: str


CPU_FIT: tuple[Reduction, ...] = (
    Reduction("layers", ("dflash", "dspark"), 1,
              "5 layers x 16 B/param (fp32 weights, grads, AdamW) is ~16 GB per side; the [rows, V] loss "
              "memory the chunked loss targets does not depend on the layer count, weights add equally"),
    Reduction("peagle_layers", ("peagle",), 1, "as layers: 4 layers are ~12 GB per side"),
    Reduction("seq_len", ("eagle3",), 1024,
              "7 TTT steps over 4096 rows at hidden 4096 take several minutes per step per side on 2 cores, and "
              "speculators keeps 7 [4096, 32000] fp32 logits for backward"),
    Reduction("seq_len", ("dflash", "dspark"), 1024,
              "speculators' eager loss holds several [B*anchors, 151936] fp32 buffers (5 GB each at the recipe's "
              "512 anchors x block 16): they do not fit 24 GiB next to the weights"),
    Reduction("num_anchors", ("dflash", "dspark"), "scaled", "the recipe's anchors per token at the reduced length"),
    Reduction("frozen_dtype", ("eagle3", "peagle", "dflash", "dspark"), "bfloat16",
              "the frozen target embedding / lm_head copies (151936 x 4096: 2.5 GB each in fp32) held in bf16 "
              "on both sides; they are not trained and count in neither side's step peak"),
)
RUN_PRESET: dict[str, Any] = {"batch": 1, "steps": 2, "warmup": 2}  # one sequence per step; memory on step 2


@dataclass(frozen=True)
class Setting:
    value: Any
    source: str
    recipe: Any = None  # the recipe's value when a CPU-fit reduction replaced it
    why: str = ""


def recipe_seq_len(family: str) -> tuple[int, str]:
    """(max_seq_len, where it came from): the family's Qwen3-8B preset, else the trainer default."""
    from omegaconf import OmegaConf

    from verl_speco.train.config import DataSection

    path = recipes.PRESET_DIR / f"qwen3_8b_{family}.yaml"
    if path.is_file():
        value = OmegaConf.select(OmegaConf.load(path), "data.max_seq_len", default=None)
        if value is not None:
            return int(value), f"configs/preset/{path.name} data.max_seq_len"
    return int(DataSection.max_seq_len), "verl_speco/train/config.py DataSection.max_seq_len (no Qwen3-8B preset)"


def recipe_dtype() -> tuple[str, str]:
    from omegaconf import OmegaConf

    path = recipes.PRESET_DIR / f"{DTYPE_PRESET}.yaml"
    value = OmegaConf.select(OmegaConf.load(path), "run.mixed_precision", default=None)
    return str(value or "float32"), f"configs/preset/{path.name} run.mixed_precision"


def recipe(family: str) -> dict[str, Setting]:
    """The Qwen3-8B recipe of `family` as bench_train_step arguments, each with its source."""
    if family not in FAMILY_FIELDS:
        raise ValueError(f"--family: got {family!r}, expected one of {', '.join(FAMILY_FIELDS)} for --shapes qwen3-8b")
    spec = recipes.QWEN3_8B
    if spec.hidden_size // spec.num_attention_heads != spec.head_dim:
        raise ValueError(f"QWEN3_8B: head_dim {spec.head_dim} != hidden / heads; the benchmark derives head_dim")
    src = "verl_speco/launchers/recipes.py QWEN3_8B"
    out = {"hidden": Setting(spec.hidden_size, src), "heads": Setting(spec.num_attention_heads, src),
           "kv_heads": Setting(spec.num_key_value_heads, src),
           "intermediate": Setting(spec.intermediate_size, src), "vocab": Setting(spec.vocab_size, src)}
    settings = recipes.drafter_recipe(family, "gpu")
    cfg = recipes.family_config(family, dict(settings))
    for arg, attr in FAMILY_FIELDS[family].items():
        where = (f"configs/drafter/{family}.yaml recipes.gpu.{attr}" if attr in settings
                 else f"{type(cfg).__name__}.{attr} default")
        out[arg] = Setting(getattr(cfg, attr), where)
    seq, seq_src = recipe_seq_len(family)
    out["seq_len"] = Setting(seq, seq_src)
    dtype, dtype_src = recipe_dtype()
    out["dtype"] = Setting(dtype, dtype_src)
    out["frozen_dtype"] = Setting("float32", "bench default (fp32 target tensors)")
    for arg, value in RUN_PRESET.items():
        out[arg] = Setting(value, "bench preset: one sequence per step" if arg == "batch" else "bench preset")
    return out


def preset(family: str, cpu_fit: bool, full_length: bool = False) -> dict[str, Setting]:
    """`recipe(family)` with the CPU_FIT reductions (when `cpu_fit`). `full_length`: keep the
    recipe's sequence length and anchors (the ours-alone memory pass) but the other reductions."""
    out = recipe(family)
    if not cpu_fit:
        return out
    for red in CPU_FIT:
        if family not in red.families or (full_length and red.arg in ("seq_len", "num_anchors")):
            continue
        old = out[red.arg]
        if red.value == "scaled":
            value = max(1, round(old.value * out["seq_len"].value / out["seq_len"].recipe))
        else:
            value = red.value
        if value != old.value:
            out[red.arg] = Setting(value, "CPU fit", old.value, red.why)
    return out


def describe(family: str, settings: dict[str, Setting], explicit: dict[str, Any]) -> list[str]:
    """Header lines: every value used (explicit flags marked), then every reduction and why."""
    used = " ".join(f"{k}={explicit.get(k, s.value)}{'(flag)' if k in explicit else ''}"
                    for k, s in sorted(settings.items()))
    lines = [f"[{family}] qwen3-8b shapes: {used}"]
    for key, s in sorted(settings.items()):
        if key in explicit and explicit[key] != s.value:
            lines.append(f"[{family}]   {key}={explicit[key]} set by its flag (preset {s.value}, from {s.source})")
        elif s.recipe is not None:
            lines.append(f"[{family}]   REDUCED {key}: recipe {s.recipe} -> {s.value}: {s.why}")
    return lines


def sources(family: str) -> list[str]:
    """Where each recipe value came from, one line per argument."""
    return [f"[{family}]   {k} = {s.value}  <- {s.source}" for k, s in sorted(recipe(family).items())]
