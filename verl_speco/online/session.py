"""The drafter side of online co-training: replay buffer, training rounds, versioned publishes.

A `DrafterSession` receives each RL step's rows with the target head of the policy version that produced
them; every optimizer step draws rows of one version and supervises them with that version's head, so a
stale row is never scored by a newer head (rows older than `max_staleness` are evicted). With W > 1 ranks
the draft is sharded with FSDP2; every rank holds the same buffer and seed and trains rows r, r + W, ... of
the same draw. Worked example, W = 2, rows [a, b, c]: rank 0 [a, c], rank 1 [b], equal to one process."""

from __future__ import annotations

import math
import random
import threading
import time
from collections import deque
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load as safetensors_load
from safetensors.torch import save as safetensors_save
from torch import Tensor, nn

from drafters.common.target import TargetHead
from drafters.registry import get_family
from verl_speco.online.capture import CapturedRows, safetensors_metadata
from verl_speco.online.config import DrafterRunConfig
from verl_speco.online.publish import PublishedDraft, publish_dir_of, write_version
from verl_speco.train.config import build_family_config
from verl_speco.train.distributed import accelerator_mixed_precision, apply_fsdp, init_single_process_group
from verl_speco.train.optim import build_optimizer, set_lr, warmup_lr
from verl_speco.train.step import train_step


@dataclass
class TargetHeadSnapshot:
    """The frozen target pieces a drafter trains against at one policy version: embed_tokens, lm_head [V, H]."""

    version: int
    embed_tokens: Tensor
    lm_head: Tensor

    @classmethod
    def from_model(cls, model: nn.Module, version: int, dtype: torch.dtype = torch.float32) -> TargetHeadSnapshot:
        """Copy from an HF causal LM (parameters may be sharded DTensors: gathered in full)."""
        def full(t: Tensor) -> Tensor:
            t = t.full_tensor() if hasattr(t, "full_tensor") else t
            return t.detach().to("cpu", dtype).clone()

        embed = model.get_input_embeddings().weight  # type: ignore[operator, union-attr]
        head = model.get_output_embeddings().weight  # type: ignore[operator, union-attr]
        return cls(int(version), full(embed), full(head))

    def to_bytes(self) -> bytes:
        """Safetensors bytes (version in the metadata): how a snapshot crosses processes."""
        return safetensors_save({"embed_tokens": self.embed_tokens.contiguous(), "lm_head": self.lm_head.contiguous()},
                                metadata={"version": str(self.version)})

    @classmethod
    def from_bytes(cls, data: bytes) -> TargetHeadSnapshot:
        tensors = safetensors_load(data)
        return cls(int(safetensors_metadata(data)["version"]), tensors["embed_tokens"], tensors["lm_head"])


@dataclass
class _Entry:
    version: int
    record: dict[str, Tensor]
    tokens: int


class FeatureBuffer:
    """Rows by policy version, bounded by staleness and by total tokens (oldest evicted first)."""

    def __init__(self, max_tokens: int, max_staleness: int):
        self.max_tokens = max_tokens
        self.max_staleness = max_staleness
        self.entries: deque[_Entry] = deque()
        self.heads: dict[int, TargetHeadSnapshot] = {}
        self.tokens = 0
        self.evicted = 0
        self.lock = threading.Lock()  # add() may run while an overlapped round samples

    @property
    def latest_version(self) -> int:
        return max(self.heads) if self.heads else -1

    def add(self, rows: CapturedRows, head: TargetHeadSnapshot) -> None:
        if head.version != rows.policy_version:
            raise ValueError(f"head.version={head.version} but rows.policy_version={rows.policy_version}: "
                             "rows must be supervised by the head of the policy that produced them")
        rows.wait()
        with self.lock:
            self.heads[head.version] = head
            for record in rows.records:
                n = int(record["input_ids"].numel())
                self.entries.append(_Entry(rows.policy_version, record, n))
                self.tokens += n
            self._evict()

    def _evict(self) -> None:
        oldest_ok = self.latest_version - self.max_staleness
        keep: deque[_Entry] = deque()
        for e in self.entries:
            if e.version < oldest_ok:
                self.tokens -= e.tokens
                self.evicted += 1
            else:
                keep.append(e)
        self.entries = keep
        while self.tokens > self.max_tokens and len(self.entries) > 1:
            e = self.entries.popleft()
            self.tokens -= e.tokens
            self.evicted += 1
        live = {e.version for e in self.entries}
        self.heads = {v: h for v, h in self.heads.items() if v in live or v == self.latest_version}

    def sample(self, rng: random.Random, n: int) -> tuple[int, list[dict[str, Tensor]], TargetHeadSnapshot]:
        """(version, up to n rows of that version, its head), in one locked read: the version is
        drawn in proportion to its rows."""
        with self.lock:
            if not self.entries:
                raise RuntimeError("FeatureBuffer.sample: the buffer is empty (nothing captured yet)")
            version = rng.choice(self.entries).version
            pool = [e.record for e in self.entries if e.version == version]
            return version, rng.sample(pool, min(n, len(pool))), self.heads[version]

    def head_of(self, version: int) -> TargetHeadSnapshot:
        with self.lock:
            return self.heads[version]


def served_depth_settings(config_cls: type, cfg: DrafterRunConfig) -> dict[str, Any]:
    """`cfg.settings` where a TTT family (`ttt_steps`) left unset trains exactly the served depth,
    `num_speculative_tokens` (docs/results/smollm2/drift/README.md, 'Sixty held-out problems')."""
    settings = dict(cfg.settings)
    if "ttt_steps" not in settings and "ttt_steps" in {f.name for f in fields(config_cls)}:
        settings["ttt_steps"] = cfg.num_speculative_tokens
    return settings


class DrafterSession:
    """Drafter model, optimizer and buffer of an online run, on one device (`device`: "cpu", "cuda:1",
    "npu:5"); see the module docstring."""

    def __init__(self, cfg: DrafterRunConfig, target_dir: str | Path, device: str | torch.device = "cpu",
                 run_name: str = "run"):
        self.cfg = cfg
        self.device = torch.device(device)
        self.family = get_family(cfg.family)
        target = TargetHead.from_pretrained(target_dir)
        settings = served_depth_settings(self.family.config_cls, cfg)
        if cfg.model_path:  # the architecture comes from the export; settings may change training only
            try:
                model: Any = self.family.with_settings(self.family.load_export(cfg.model_path, target),
                                                       **settings)
            except ValueError as e:
                raise ValueError(f"actor_rollout_ref.rollout.drafter.{e} (model_path={cfg.model_path!r})") from None
            self.fam_cfg = self.family.config_of(model)
        else:
            raw = build_family_config(self.family.config_cls, settings, cfg.family)
            self.fam_cfg = self.family.resolve(raw, target.spec)
            with torch.random.fork_rng(devices=[]):  # a fresh init is a function of drafter.seed
                torch.manual_seed(cfg.seed)
                model = self.family.build(self.fam_cfg, target, None)
        self.target_spec = target.spec
        self.engine_format = self.family.engine_format(self.fam_cfg, self.target_spec)
        self.model: nn.Module = model.to(self.device).train()
        self.mixed_precision = accelerator_mixed_precision(self.device.type)  # bfloat16 off the CPU
        if self.mixed_precision is not None and not dist.is_initialized():
            init_single_process_group(self.device)  # FSDP2 carries the mixed precision, also alone
        self.rank, self.world = (dist.get_rank(), dist.get_world_size()) if dist.is_initialized() else (0, 1)
        if self.world > 1 or self.mixed_precision is not None:
            apply_fsdp(self.model, self.device, self.mixed_precision, reshard_after_forward=True)
        self._held: TargetHeadSnapshot | None = None  # the snapshot the model's frozen pieces hold
        self._on_device: dict[int, tuple[TargetHeadSnapshot, Tensor, Tensor]] = {}  # version -> it, moved
        self.optimizer = build_optimizer(self.model.parameters(), cfg.optim)
        self.buffer = FeatureBuffer(cfg.buffer_max_tokens, cfg.max_staleness)
        self.rng = random.Random(cfg.seed)
        self.step = 0
        self.rounds = 0
        self.rows_since_round = 0  # rows added since the previous round began (derived round length)
        self.version = 0
        self.publish_dir = publish_dir_of(cfg.publish_dir, run_name)

    def add(self, rows: CapturedRows, head: TargetHeadSnapshot) -> None:
        self.buffer.add(rows, head)
        self.rows_since_round += len(rows.records)

    def next_round_steps(self) -> int:
        """Optimizer steps of the next round: 0 with an empty buffer; else `train_steps_per_round` when
        set; else ceil(train_passes_per_round * rows added since the previous round / micro_batch_size)
        (0 when none was added). Every rank holds the same buffer, so every rank derives the same count."""
        if self.buffer.tokens == 0:
            return 0
        if self.cfg.train_steps_per_round is not None:
            return self.cfg.train_steps_per_round
        return math.ceil(self.cfg.train_passes_per_round * self.rows_since_round / self.cfg.micro_batch_size)

    def take_round_steps(self, steps: int | None) -> int:
        """`steps`, or `next_round_steps()`; either way the rows since the previous round are consumed
        (`session_link.SessionLink` fixes a background round's length this way before it starts)."""
        steps = self.next_round_steps() if steps is None else steps
        self.rows_since_round = 0
        return steps

    def _use_head(self, head: TargetHeadSnapshot) -> None:
        """Point the model's frozen target pieces at `head`, moved to the device once per snapshot (in
        its own dtype) and kept there while its version is buffered."""
        if head is self._held:
            return
        with self.buffer.lock:
            live = set(self.buffer.heads)
        self._on_device = {v: c for v, c in self._on_device.items() if v in live}
        moved = self._on_device.get(head.version)
        if moved is None or moved[0] is not head:
            moved = (head, head.embed_tokens.to(self.device), head.lm_head.to(self.device))
            self._on_device[head.version] = moved
        self.family.set_target_head(self.model, moved[1], moved[2])
        self._held = head

    def _rank_rows(self, samples: list[dict[str, Tensor]]) -> list[dict[str, Tensor]]:
        """This rank's share of a global draw (module docstring: rows r, r + W, ...; never empty)."""
        if self.world == 1:
            return samples
        return [samples[i % len(samples)] for i in range(self.rank, max(len(samples), self.world), self.world)]


    def progress(self) -> float:
        """The objective's `progress` (curricula): the fraction of `curriculum_steps` optimizer steps
        done, 1.0 throughout when curriculum_steps is 0 (a drafter that arrives trained)."""
        horizon = self.cfg.curriculum_steps
        return 1.0 if horizon == 0 else min(1.0, self.step / horizon)

    def train_round(self, steps: int | None = None) -> dict[str, float]:
        """`steps` (default `next_round_steps()`) optimizer steps on buffered rows; metrics."""
        started = time.perf_counter()
        steps = self.take_round_steps(steps)
        latest = self.buffer.latest_version
        latest_head = self.buffer.head_of(latest)  # kept even if add() evicts it during the round
        losses, tokens, skipped, lags = [], 0, 0, []
        acc: dict[str, list[float]] = {}
        for _ in range(steps):
            version, samples, head = self.buffer.sample(self.rng, self.cfg.micro_batch_size)
            samples = self._rank_rows(samples)
            self._use_head(head)
            set_lr(self.optimizer, warmup_lr(self.step, self.cfg.optim.lr, self.cfg.optim.warmup_steps))
            result = train_step(self.model, self.family, [samples], self.optimizer, self.cfg.optim.grad_clip,
                                self.device, self.cfg.optim.denominators, progress=self.progress())
            self.step += 1
            skipped += int(result.skipped)
            tokens += result.tokens
            lags.append(latest - version)
            if math.isfinite(result.loss):
                losses.append(result.loss)
            for k, v in result.metrics.items():
                acc.setdefault(k, []).append(v)
        self._use_head(latest_head)
        self.rounds += 1
        out = {"loss": sum(losses) / max(1, len(losses)), "tokens": float(tokens), "steps": float(steps),
               "skipped_steps": float(skipped), "staleness_mean": sum(lags) / max(1, len(lags)),
               "staleness_max": float(max(lags, default=0)), "buffer_tokens": float(self.buffer.tokens),
               "buffer_evicted": float(self.buffer.evicted), "train_seconds": time.perf_counter() - started}
        out.update({k: sum(v) / len(v) for k, v in acc.items() if v})
        return out

    def _full_state_dict(self) -> dict[str, Tensor]:
        """The model's state dict with FSDP2-sharded parameters gathered in full (a collective when
        W > 1: every rank calls it), on CPU."""
        out = {}
        for k, v in self.model.state_dict().items():
            v = v.full_tensor() if hasattr(v, "full_tensor") else v
            out[k] = v.detach().cpu()
        return out

    def engine_state(self) -> dict[str, Tensor]:
        """A copy of the draft in the engine's checkpoint names (the family's native format), CPU
        tensors (a collective when W > 1)."""
        tensors = self.engine_format.engine_tensors(self._full_state_dict(), "native")
        return {k: v.clone() for k, v in tensors.items()}  # a snapshot: never aliases live parameters

    def export(self, out_dir: str | Path) -> Path:
        """The draft as an engine-loadable native export directory (written by rank 0; a collective)."""
        state = self._full_state_dict()
        out = Path(out_dir)
        if self.rank == 0:
            self.engine_format.export(state, out, "native")
        return out

    def publish(self, out_dir: str | Path | None = None) -> PublishedDraft | None:
        """Write the current draft as the next version (bucketed safetensors; see publish.py).
        Every rank calls it (the gather is a collective); rank 0 writes and returns the version."""
        self.version += 1
        state = self.engine_state()
        if self.rank != 0:
            return None
        return write_version(out_dir or self.publish_dir, self.version, state,
                             meta={"optimizer_step": self.step, "policy_version": self.buffer.latest_version,
                                   "engine_format": self.engine_format.to_dict()})

