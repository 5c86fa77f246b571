"""Typed schema of the drafter settings of an RL run: `actor_rollout_ref.rollout.drafter.*` (added by
`configs/speco_trainer.yaml`). `DrafterRunConfig.from_dict` is the only reader: an unknown key or bad value
fails naming it. Modes (docs/design/architecture.md section 1): `online`, `collect_only`, `offline`."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from verl_speco.train.config import OptimConfig

MODES = ("online", "collect_only", "offline")
SCHEDULES = ("serial", "overlap")
CAPTURE_PASSES = ("old_logprob", "post_update")
CAPTURE_SOURCES = ("actor", "rollout", "auto")
# `optim` settings the online drafter fixes (OptimConfig is shared with the standalone trainer):
# it has no planned total of steps and takes one micro-batch per optimizer step
ONLINE_OPTIM = {"warmup_ratio": (0.0, "0.0 (the online drafter has no planned total steps: use warmup_steps)"),
                "schedule": ("constant", "'constant' (the online drafter has no planned total steps: warmup_steps, "
                                         "then a constant lr)"),
                "grad_accum": (1, "1 (the online drafter takes one micro-batch of micro_batch_size rows per step)")}


ONLINE_LR = 1e-3


class DrafterConfigError(ValueError):
    """A drafter setting of the RL run has a value we cannot use."""


def floating_dtype(name: Any, key: str) -> Any:
    """The torch dtype named `name` ('bfloat16', 'float32', ...); `DrafterConfigError` naming `key` and the
    value when it is not a floating dtype."""
    import torch

    dtype = getattr(torch, str(name), None)
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise DrafterConfigError(f"{key}: got {name!r}, expected a floating torch dtype name such as 'bfloat16' "
                                 "or 'float32'")
    return dtype


@dataclass
class CaptureCaps:
    """Per-RL-step limits on what the old-logprob capture keeps (rows sampled, never silently)."""

    max_rows: int = 64  # sequences kept per step (a seeded random subset of the batch)
    max_tokens: int = 32768  # total tokens kept per step (rows are dropped whole past it)
    min_response_tokens: int = 1  # responses shorter than this are counted as `dropped_short`
    max_seq_len: int = 4096  # longer rows are truncated (counted as `truncated`)


@dataclass
class FeatureStoreSink:
    path: str | None = None  # collect_only: the store root (one writer per rank)
    hidden_dtype: str = "bfloat16"  # dtype of stored hidden states (as read back)
    hidden_encoding: str = "raw"  # raw | fp8_e4m3 (e4m3 + a float32 scale per token: about half of bf16's bytes)
    flush_samples: int = 256  # also flushed at every RL step boundary


@dataclass
class DrafterRunConfig:
    enable: bool = False
    family: str = "eagle3"  # drafters.registry name
    mode: str = "online"  # online | collect_only | offline
    model_path: str | None = None  # initial draft export (native / speculators); None: fresh init
    settings: dict[str, Any] = field(default_factory=dict)  # -> family.config_cls(**settings)
    num_speculative_tokens: int = 3  # what the rollout engine drafts per step at most (and the depth trained)
    # fixed: k = num_speculative_tokens at every batch size. auto: the k per batch size planned from
    # `speculation_calibration` (`verl-speco-speculation calibrate`), 0 where drafting does not pay; vLLM
    # 0.32 only (verl_speco.speculation.apply). null: auto where the rollout engine takes a schedule.
    speculation: str | None = None
    speculation_calibration: str | None = None  # calibration.json measured on this hardware, target and draft
    collect_interval: int = 1  # capture every N RL steps
    train_interval: int = 1  # run a training round every N RL steps
    publish_interval: int = 1  # publish after every N training rounds
    # optimizer steps per training round. None: derived from the rows captured since the previous round,
    # so that each is drawn about `train_passes_per_round` times (`DrafterSession.next_round_steps`).
    # Worked example: 4 prompts x 4 rollouts = 16 rows, 4 passes, micro_batch_size 8 -> ceil(16 * 4 / 8) = 8
    # steps; 8 prompts x 4 rollouts -> 16. A fixed 8 at 32 rows a step halved the passes and the draft's
    # margin on a moving policy (docs/results/smollm2/drift/README.md, the lever study).
    train_steps_per_round: int | None = None
    train_passes_per_round: float = 4.0  # with train_steps_per_round=None: draws of each new row per round
    # online optimizer steps over which the objective's progress goes 0 -> 1 (curricula: Domino's
    # lambda); 0 = progress 1 throughout (the drafter arrives trained, its curriculum done)
    curriculum_steps: int = 0
    micro_batch_size: int = 8  # samples per optimizer step
    schedule: str = "serial"  # serial: after the actor update; overlap: during the next rollout
    # old_logprob: hooks on verl's old-logprob forward (no extra compute; rows of the policy before the
    # update, so the draft the next rollout serves lags the policy by one update). post_update: one extra
    # forward of the updated actor over the step's batch right after the update (rows of the very policy
    # the next rollout runs; costs one forward pass of the actor per capturing step).
    # Default post_update: with old_logprob the co-trained draft lags a moving policy by a full update
    # (docs/results/drift_grpo/README.md, "What bounds the co-trained drafter's lag").
    capture_pass: str = "post_update"
    # where hidden states come from. actor: the actor's forward (capture_pass). rollout: the rollout
    # engine returns them with each generated sequence (rollout.name=sglang; verl_speco.engines.sglang_capture);
    # refused when the rollout cannot give the family's layout. auto: rollout where it can, else actor
    # (with one log line naming why).
    capture_source: str = "actor"
    # every validation (trainer.test_freq) also decodes the held-out set with the run's initial draft on
    # the same policy: drafter/heldout_baseline/* and drafter/heldout/gain (co-trained over initial mean
    # acceptance length), a paired measure of what co-training buys; costs one more validation pass
    # (online mode, vLLM rollout: SGLang reports no acceptance counters)
    heldout_baseline: bool = False
    # fresh samples: after every actor update (and its weight sync), the rollout engine samples one response
    # for each of this many training prompts from the UPDATED policy (the rollout's sampling parameters,
    # a prompt order of its own, seeded by `seed`: the RL data order is untouched), the actor captures them,
    # and the round trains on them with the step's rows. Without them the served draft has seen only
    # text of the policy before the update, so it lags a format change by one step. Costs a generation of
    # that many responses, one actor forward over them and a second weight sync a step. 0: off.
    # Online, schedule=serial, capture_source=actor, verl's sync trainer.
    fresh_samples: int = 0
    # rows of versions older than (newest - max_staleness) are evicted: 0 keeps the newest version only,
    # 1 the newest and the one before it
    max_staleness: int = 1
    buffer_max_tokens: int = 262144  # replay buffer capacity (oldest evicted first)
    seed: int = 0
    publish_dir: str | None = None  # where published draft versions are written (default: tmp)
    num_gpus: float = 0.0  # accelerators reserved for each drafter actor (outside verl's pools); 0: CPU
    num_workers: int = 1  # drafter actors; > 1: FSDP2 data parallel over them (one node)
    caps: CaptureCaps = field(default_factory=CaptureCaps)
    # shared with the standalone trainer; online lr 1e-3 (the offline recipes' lr): at 1e-4 the draft
    # could not follow a policy that moves every step (the lag study above)
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(lr=ONLINE_LR))
    feature_store: FeatureStoreSink = field(default_factory=FeatureStoreSink)

    @classmethod
    def from_dict(cls, raw: dict[str, Any] | None) -> DrafterRunConfig:
        cfg = _build(cls, dict(raw or {}), "drafter")
        return cfg.validate()

    def validate(self) -> DrafterRunConfig:
        def bad(key: str, value: Any, expected: str) -> DrafterConfigError:
            return DrafterConfigError(f"actor_rollout_ref.rollout.drafter.{key}: got {value!r}, expected {expected}")

        if self.mode not in MODES:
            raise bad("mode", self.mode, f"one of {MODES}")
        if self.schedule not in SCHEDULES:
            raise bad("schedule", self.schedule, f"one of {SCHEDULES}")
        if self.capture_pass not in CAPTURE_PASSES:
            raise bad("capture_pass", self.capture_pass, f"one of {CAPTURE_PASSES}")
        if self.capture_source not in CAPTURE_SOURCES:
            raise bad("capture_source", self.capture_source, f"one of {CAPTURE_SOURCES}")
        if self.train_steps_per_round is not None and (
                isinstance(self.train_steps_per_round, bool) or not isinstance(self.train_steps_per_round, int)
                or self.train_steps_per_round < 1):
            raise bad("train_steps_per_round", self.train_steps_per_round,
                      "an integer >= 1, or null (derived from train_passes_per_round)")
        if isinstance(self.train_passes_per_round, bool) or not isinstance(self.train_passes_per_round, (int, float)) \
                or not math.isfinite(self.train_passes_per_round) or self.train_passes_per_round <= 0:
            raise bad("train_passes_per_round", self.train_passes_per_round, "a finite number > 0")
        for key in ("collect_interval", "train_interval", "publish_interval",
                    "micro_batch_size", "num_speculative_tokens", "buffer_max_tokens", "num_workers"):
            if getattr(self, key) < 1:
                raise bad(key, getattr(self, key), "an integer >= 1")
        if self.num_gpus < 0:
            raise bad("num_gpus", self.num_gpus, "a number >= 0")
        if self.max_staleness < 0:
            raise bad("max_staleness", self.max_staleness, "an integer >= 0")
        if self.curriculum_steps < 0:
            raise bad("curriculum_steps", self.curriculum_steps, "an integer >= 0 (0: no online curriculum)")
        for key in ("max_rows", "max_tokens", "min_response_tokens", "max_seq_len"):
            if getattr(self.caps, key) < 1:
                raise bad(f"caps.{key}", getattr(self.caps, key), "an integer >= 1")
        for key, value, expected in self.optim.problems():
            raise bad(f"optim.{key}", value, expected)
        for key, (fixed, expected) in ONLINE_OPTIM.items():
            if getattr(self.optim, key) != fixed:
                raise bad(f"optim.{key}", getattr(self.optim, key), expected)
        if isinstance(self.fresh_samples, bool) or not isinstance(self.fresh_samples, int) or self.fresh_samples < 0:
            raise bad("fresh_samples", self.fresh_samples, "an integer >= 0 (0: off)")
        if self.fresh_samples and self.enable and (self.mode, self.schedule, self.capture_source) != (
                "online", "serial", "actor"):
            raise bad("fresh_samples", self.fresh_samples, f"0 with mode={self.mode}, schedule={self.schedule}, "
                      f"capture_source={self.capture_source} (fresh samples train the round that blocks the step: "
                      "mode=online, schedule=serial, capture_source=actor)")
        if self.speculation not in (None, "fixed", "auto"):
            raise bad("speculation", self.speculation, "'fixed', 'auto' or null (auto where the engine takes a schedule)")
        if self.speculation_calibration and (self.speculation == "fixed" or self.mode != "online"):
            raise bad("speculation_calibration", self.speculation_calibration,
                      f"null with speculation={self.speculation} and mode={self.mode} (a schedule applies to the "
                      "draft an online rollout serves, with speculation auto or null)")
        if self.heldout_baseline and self.speculation_calibration:
            raise bad("heldout_baseline", self.heldout_baseline, "false with a speculation_calibration: the held-out "
                      "acceptance is read off the validation pass, whose batch the schedule may draft nothing at "
                      "(set speculation=fixed to compare drafts)")
        if self.heldout_baseline and self.mode != "online":
            raise bad("heldout_baseline", self.heldout_baseline, "false unless mode=online (it compares the served "
                      "draft with the initial one)")
        if self.enable and self.mode == "collect_only" and not self.feature_store.path:
            raise bad("feature_store.path", self.feature_store.path, "a store directory in collect_only mode")
        return self


def _build(cls: type, raw: dict[str, Any], where: str, default: Any = None) -> Any:
    """Recursive dataclass construction that names unknown keys; a nested section starts from the
    default its owner declares (`default`), so only the given keys change."""
    names = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(raw) - set(names))
    if unknown:
        raise DrafterConfigError(f"actor_rollout_ref.rollout.{where}: unknown key(s) {unknown}; "
                                 f"valid keys are {sorted(names)}")
    kwargs: dict[str, Any] = {}
    for key, value in raw.items():
        factory: Any = names[key].default_factory
        sub = factory() if factory is not dataclasses.MISSING else None
        if dataclasses.is_dataclass(sub) and not isinstance(sub, type):
            if not isinstance(value, dict):
                raise DrafterConfigError(f"actor_rollout_ref.rollout.{where}.{key}: got {value!r}, expected a mapping")
            kwargs[key] = _build(type(sub), dict(value), f"{where}.{key}", sub)
        else:
            kwargs[key] = value
    return cls(**kwargs) if default is None else dataclasses.replace(default, **kwargs)
