"""Typed schema of the standalone drafter trainer (`verl-speco-draft-train`).

The dataclasses below are the single source of truth: they are registered with Hydra's
ConfigStore as `draft_trainer_schema`, `configs/draft_trainer.yaml` lists that schema first in
its defaults, so a key that is not in the schema (a typo, a stale option) fails at composition.
Family-specific drafter settings stay an open dict here and are validated by the family's own
config dataclass (`family.config_cls`) in `build_family_config`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

# omegaconf.MISSING: OmegaConf (Hydra's structured configs) reads this exact string as a mandatory
# value not yet set. Spelled out so the schema imports without omegaconf (scripts/gpu_check.py runs
# on machines without it); tests/scripts/test_gpu_check.py keeps it equal to omegaconf's.
MISSING: Any = "???"


class ConfigError(ValueError):
    """A trainer setting has a value the trainer cannot use."""


@dataclass
class DrafterSection:
    family: str = "eagle3"  # a name from drafters.registry.available_families()
    settings: dict[str, Any] = field(default_factory=dict)  # -> family.config_cls(**settings)
    export_formats: list[str] = field(default_factory=list)  # empty: the family's default format
    # the family's sized setting sets (gpu, npu, real_target) that launchers, presets and benchmarks read
    # (configs/drafter/<family>.yaml; verl_speco/launchers/recipes.py); the trainer trains `settings`
    recipes: dict[str, Any] = field(default_factory=dict)


@dataclass
class TargetSection:
    path: str = MISSING  # HF directory: config.json + *.safetensors (embed, norm, lm_head)


@dataclass
class DataSection:
    store: str = MISSING  # Feature Store root written by feature_store.StoreWriter
    eval_store: str | None = None  # held-out store; else `eval_fraction` of `store` is held out
    eval_fraction: float = 0.0
    eval_samples: int = 64  # held-out samples scored at each eval (split across ranks)
    seed: int = 0  # shuffle seed of the reader
    shuffle: bool = True
    prefetch: int = 2
    micro_batch_size: int = 1  # samples per micro-batch per rank (when token_budget is null)
    token_budget: int | None = None  # pack micro-batches up to this many tokens instead
    max_seq_len: int = 2048  # longer samples are truncated
    verify_checksums: bool = True  # each shard's checksum, once, when first read (false: skip)


SCHEDULES = ("cosine", "linear", "constant")
DENOMINATORS = ("retain", "prepass")


@dataclass
class OptimConfig:
    """AdamW and its learning-rate schedule (verl_speco/train/optim.py): the `optim` section of the
    standalone trainer (`TrainerConfig.optim`, schedule cosine by default) and of the online drafter
    (`actor_rollout_ref.rollout.drafter.optim`, `verl_speco.online.config.DrafterRunConfig`, which
    has no planned total: warmup then a constant lr, one micro-batch per step). `problems()` is its
    validation, for both."""

    lr: float = 1e-4
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    weight_decay: float = 0.0
    eps: float = 1e-8
    warmup_steps: int = 0  # takes precedence over warmup_ratio when > 0
    warmup_ratio: float = 0.0  # fraction of run.total_steps
    schedule: str = "constant"  # cosine | linear | constant (after warmup)
    min_lr_ratio: float = 0.0  # the decay ends at lr * min_lr_ratio
    grad_clip: float = 1.0  # max global grad norm; <= 0 disables clipping
    grad_accum: int = 1  # micro-batches per rank per optimizer step
    # how the global denominators are obtained before backward (verl_speco/train/step.py):
    # retain: keep all grad_accum graphs, one backward; prepass: +1 no-grad forward, constant memory
    denominators: str = "retain"

    def problems(self) -> list[tuple[str, Any, str]]:
        """(field, value, what was expected) of every invalid setting, in field order; [] when valid."""
        betas = list(self.betas)
        checks = [
            (self.lr > 0, "lr", self.lr, "> 0"),
            (len(betas) == 2 and all(0 <= b < 1 for b in betas), "betas", betas, "two values in [0, 1)"),
            (self.warmup_steps >= 0, "warmup_steps", self.warmup_steps, ">= 0"),
            (0.0 <= self.warmup_ratio < 1.0, "warmup_ratio", self.warmup_ratio, "in [0, 1)"),
            (self.schedule in SCHEDULES, "schedule", self.schedule, f"one of {', '.join(SCHEDULES)}"),
            (0.0 <= self.min_lr_ratio <= 1.0, "min_lr_ratio", self.min_lr_ratio, "in [0, 1]"),
            (self.grad_accum >= 1, "grad_accum", self.grad_accum, ">= 1"),
            (self.denominators in DENOMINATORS, "denominators", self.denominators, " or ".join(DENOMINATORS)),
        ]
        return [(key, value, expected) for ok, key, value, expected in checks if not ok]


@dataclass
class RunSection:
    out_dir: str = "runs/draft"
    total_steps: int = 1000  # optimizer steps (sets the LR schedule)
    stop_after: int | None = None  # end this invocation (with a checkpoint) after N steps
    save_every: int = 500  # checkpoint period in steps; the last step is always saved
    keep_last: int = 0  # keep only the newest K checkpoints (0: keep all)
    eval_every: int = 0  # 0: no periodic eval (still one at the end when eval data exist)
    log_every: int = 1
    seed: int = 0  # model init + torch RNG
    resume: Any = False  # false | true (latest complete checkpoint in out_dir, else fresh) | checkpoint path
    overwrite: bool = False  # a fresh run into an out_dir holding checkpoints: delete them (else fail)
    device: str = "auto"  # auto | cpu | cuda | npu
    dtype: str = "float32"  # dtype of the trainable (master) weights
    mixed_precision: str | None = None  # compute dtype under FSDP2 (e.g. bfloat16); null: off
    progress_bar: bool = True
    tensorboard: bool = True


@dataclass
class DistSection:
    backend: str = "auto"  # auto -> nccl (cuda) | hccl (npu) | gloo (cpu)
    reshard_after_forward: bool = True
    timeout_s: int = 1800


@dataclass
class TrainerConfig:
    drafter: DrafterSection = field(default_factory=DrafterSection)
    target: TargetSection = field(default_factory=TargetSection)
    data: DataSection = field(default_factory=DataSection)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(schedule="cosine"))
    run: RunSection = field(default_factory=RunSection)
    dist: DistSection = field(default_factory=DistSection)


SCHEMA_NAME = "draft_trainer_schema"
_DTYPES = ("float32", "bfloat16", "float16")


def register_schema() -> None:
    """Register `TrainerConfig` with Hydra's ConfigStore (idempotent)."""
    from hydra.core.config_store import ConfigStore

    ConfigStore.instance().store(name=SCHEMA_NAME, node=TrainerConfig)


def _check(ok: bool, key: str, value: Any, expected: str) -> None:
    if not ok:
        raise ConfigError(f"{key}={value!r}: expected {expected}")


def validate(cfg: TrainerConfig) -> TrainerConfig:
    """Cross-field checks the type system cannot express; returns `cfg` unchanged."""
    d, o, r = cfg.data, cfg.optim, cfg.run
    _check(d.micro_batch_size >= 1, "data.micro_batch_size", d.micro_batch_size, ">= 1")
    _check(d.token_budget is None or d.token_budget >= 1, "data.token_budget", d.token_budget,
           "null or >= 1")
    _check(d.max_seq_len >= 2, "data.max_seq_len", d.max_seq_len, ">= 2")
    _check(0.0 <= d.eval_fraction < 1.0, "data.eval_fraction", d.eval_fraction, "in [0, 1)")
    _check(d.eval_samples >= 0, "data.eval_samples", d.eval_samples, ">= 0")
    for key, value, expected in o.problems():
        _check(False, f"optim.{key}", value, expected)
    _check(r.total_steps >= 1, "run.total_steps", r.total_steps, ">= 1")
    _check(r.stop_after is None or r.stop_after >= 1, "run.stop_after", r.stop_after, "null or >= 1")
    _check(r.save_every >= 0, "run.save_every", r.save_every, ">= 0 (0: only at the end)")
    _check(r.keep_last >= 0, "run.keep_last", r.keep_last, ">= 0")
    _check(r.eval_every >= 0, "run.eval_every", r.eval_every, ">= 0")
    _check(r.log_every >= 1, "run.log_every", r.log_every, ">= 1")
    _check(r.device in ("auto", "cpu", "cuda", "npu"), "run.device", r.device,
           "one of auto, cpu, cuda, npu")
    _check(r.dtype in _DTYPES, "run.dtype", r.dtype, f"one of {', '.join(_DTYPES)}")
    _check(r.mixed_precision is None or r.mixed_precision in _DTYPES, "run.mixed_precision",
           r.mixed_precision, f"null or one of {', '.join(_DTYPES)}")
    _check(isinstance(r.resume, (bool, str)), "run.resume", r.resume,
           "true, false or a checkpoint directory")
    _check(cfg.dist.backend in ("auto", "gloo", "nccl", "hccl"), "dist.backend", cfg.dist.backend,
           "one of auto, gloo, nccl, hccl")
    return cfg


def build_family_config(config_cls: type, settings: dict[str, Any], family: str) -> Any:
    """`config_cls(**settings)` with unknown keys reported by name (never silently dropped)."""
    if dataclasses.is_dataclass(config_cls):
        known = {f.name for f in dataclasses.fields(config_cls)}
        unknown = sorted(set(settings) - known)
        if unknown:
            raise ConfigError(
                f"drafter.settings has unknown key(s) {unknown} for family {family!r}; "
                f"expected a subset of {sorted(known)}")
    try:
        return config_cls(**settings)
    except (TypeError, ValueError) as err:
        raise ConfigError(f"drafter.settings={settings!r} invalid for family {family!r}: {err}") from err


def warmup_steps(cfg: TrainerConfig) -> int:
    o = cfg.optim
    return o.warmup_steps if o.warmup_steps > 0 else int(round(o.warmup_ratio * cfg.run.total_steps))
