"""Capture during the RL step: hooks on the actor's forward, rows planned from the masks under caps, cut
out of the activations (padded [B, T, H] or packed [1, nnz, H]), copied to host without blocking, tagged
with the policy version; rows not kept are counted by reason. A row is the valid tokens of one sequence:
    input_ids      [p, p, a, b, c, p]    attention_mask [0, 0, 1, 1, 1, 0]
    loss_mask      [0, 0, 0, 1, 1, 0]    -> row input_ids [a, b, c], loss_mask [0, 1, 1]"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from safetensors.torch import load as safetensors_load
from safetensors.torch import save as safetensors_save
from torch import Tensor, nn

from verl_speco.capture.hooks import CapturedFeatures, FeatureCapture
from verl_speco.online.config import CaptureCaps


@dataclass
class RowPlan:
    """Which rows of a batch to keep: batch indices, and per kept row its length after the cap."""

    rows: list[int]  # kept batch rows, in batch order
    lengths: list[int]  # valid tokens kept per kept row (truncated to caps.max_seq_len)
    valid_counts: list[int]  # valid tokens of every batch row (for remove-padding offsets)
    counts: dict[str, int] = field(default_factory=dict)


def plan_rows(attention_mask: Tensor, loss_mask: Tensor, caps: CaptureCaps, seed: int) -> RowPlan:
    """Seeded sample of rows under the caps (attention_mask, loss_mask: [B, T]): rows in a seeded random
    order, dropped as `dropped_short`, `dropped_rows_cap` or `dropped_tokens_cap`."""
    if attention_mask.shape != loss_mask.shape or attention_mask.dim() != 2:
        raise ValueError(f"attention_mask {tuple(attention_mask.shape)} and loss_mask {tuple(loss_mask.shape)}: "
                         "expected the same [batch, seq] shape")
    am = attention_mask.bool().cpu()
    lm = (loss_mask.bool().cpu() & am)
    valid = am.sum(1).tolist()
    counts = dict.fromkeys(("seen", "kept", "truncated", "dropped_short", "dropped_rows_cap",
                            "dropped_tokens_cap", "tokens"), 0)
    counts["seen"] = len(valid)
    order = torch.randperm(len(valid), generator=torch.Generator().manual_seed(seed)).tolist()
    kept: dict[int, int] = {}
    tokens = 0
    for b in order:
        length = min(valid[b], caps.max_seq_len)
        response = int(lm[b][am[b]][:length].sum())
        if response < caps.min_response_tokens:
            counts["dropped_short"] += 1
            continue
        if len(kept) >= caps.max_rows:
            counts["dropped_rows_cap"] += 1
            continue
        if tokens + length > caps.max_tokens:
            counts["dropped_tokens_cap"] += 1
            continue
        counts["truncated"] += int(length < valid[b])
        kept[b] = length
        tokens += length
    rows = sorted(kept)
    counts["kept"], counts["tokens"] = len(rows), tokens
    return RowPlan(rows=rows, lengths=[kept[b] for b in rows], valid_counts=valid, counts=counts)


@dataclass
class CapturedRows:
    """Host-side rows of one capture with their policy version: records[i] input_ids [T_i] int64, loss_mask
    [T_i] uint8, aux_hidden [T_i, k*H], last_hidden [T_i, H]; `wait()` before reading (copies in flight)."""

    records: list[dict[str, Tensor]]
    policy_version: int
    counts: dict[str, int]
    _event: object | None = None

    def wait(self) -> CapturedRows:
        """Block until the device-to-host copies of `records` are done (`copies_done_event`)."""
        if self._event is not None:
            self._event.synchronize()  # type: ignore[attr-defined]
            self._event = None
        return self

    @property
    def num_tokens(self) -> int:
        return sum(int(r["input_ids"].numel()) for r in self.records)

    def to_bytes(self) -> bytes:
        """Safetensors bytes (tensors `"{row}.{field}"`, metadata JSON): how rows cross processes."""
        self.wait()
        tensors = {f"{i}.{k}": v.contiguous() for i, r in enumerate(self.records) for k, v in r.items()}
        meta = {"policy_version": str(self.policy_version), "rows": str(len(self.records)),
                "counts": json.dumps(self.counts)}
        return safetensors_save(tensors, metadata=meta)

    @classmethod
    def from_bytes(cls, data: bytes) -> CapturedRows:
        tensors = safetensors_load(data)
        meta = safetensors_metadata(data)
        records: list[dict[str, Tensor]] = [{} for _ in range(int(meta["rows"]))]
        for key, value in tensors.items():
            row, field_name = key.split(".", 1)
            records[int(row)][field_name] = value
        return cls(records, int(meta["policy_version"]), json.loads(meta["counts"]))


def safetensors_metadata(data: bytes) -> dict[str, str]:
    """The `__metadata__` of a safetensors buffer (8-byte little-endian header length, JSON header)."""
    size = int.from_bytes(data[:8], "little")
    meta: dict[str, str] = json.loads(data[8: 8 + size]).get("__metadata__", {})
    return meta


def _to_host(t: Tensor) -> Tensor:
    if t.device.type == "cpu":
        return t
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t, non_blocking=True)
    return out


def copies_done_event(source: torch.device) -> Any | None:
    """An event recorded on `source`'s current stream after the non-blocking copies were queued (None
    for CPU sources), from the device module's own Event, so `CapturedRows.wait` works on any accelerator."""
    if source.type == "cpu":
        return None
    module = getattr(torch, source.type)
    event = module.Event()
    event.record(module.current_stream(source))
    return event


def _row_slices(feat: Tensor, plan: RowPlan, attention_mask: Tensor) -> list[Tensor]:
    """Per kept row its valid tokens [len, ...] from padded [B, T, ...] or packed [1, nnz, ...]."""
    if feat.shape[0] == attention_mask.shape[0] and feat.shape[1] == attention_mask.shape[1]:
        am = attention_mask.bool().to(feat.device)
        return [feat[b][am[b]][:n] for b, n in zip(plan.rows, plan.lengths)]
    nnz = sum(plan.valid_counts)
    if feat.shape[0] == 1 and feat.shape[1] == nnz:
        starts = [0]
        for c in plan.valid_counts:
            starts.append(starts[-1] + c)
        return [feat[0, starts[b]: starts[b] + n] for b, n in zip(plan.rows, plan.lengths)]
    raise ValueError(f"captured activations {tuple(feat.shape)}: expected padded {tuple(attention_mask.shape)}+[H] "
                     f"or remove-padding [1, {nnz}, H]")


class OnlineCapture:
    """Capture for the RL step (inside the actor's old-logprob pass)::

        with cap.hooks(actor_module) as hooked:
            old_log_probs = actor.compute_log_prob(batch)      # the forward verl runs anyway
        rows = cap.collect(hooked.pop_all(), input_ids, attention_mask, response_mask, version)"""

    def __init__(self, layer_ids: tuple[int, ...], caps: CaptureCaps, seed: int = 0,
                 hidden_dtype: torch.dtype = torch.bfloat16):
        self.layer_ids = tuple(int(i) for i in layer_ids)
        self.caps = caps
        self.seed = int(seed)
        self.hidden_dtype = hidden_dtype

    @contextmanager
    def hooks(self, module: nn.Module) -> Iterator[FeatureCapture]:
        """Hooks on `module`; activations stay on their device (cut and moved in `collect`)."""
        with FeatureCapture(module, self.layer_ids, last_hidden=True, dtype=self.hidden_dtype,
                            device=None) as cap:
            yield cap

    def collect(self, passes: list[CapturedFeatures], input_ids: Tensor, attention_mask: Tensor,
                loss_mask: Tensor, policy_version: int) -> CapturedRows:
        """Rows of one batch. `passes` are the forwards of that batch in order (verl splits it into
        micro-batches: their rows are concatenated). input_ids/attention_mask/loss_mask: [B, T]."""
        if not passes:
            raise ValueError("collect: no forward pass was captured (were the hooks on the actor module?)")
        feats = _concat_passes(passes, tuple(attention_mask.shape))
        plan = plan_rows(attention_mask, loss_mask, self.caps, self.seed + 1_000_003 * int(policy_version))
        aux = _row_slices(feats.aux_hidden, plan, attention_mask) if self.layer_ids else None
        assert feats.last_hidden is not None
        last = _row_slices(feats.last_hidden, plan, attention_mask)
        am = attention_mask.bool().cpu()
        records = []
        for i, (b, n) in enumerate(zip(plan.rows, plan.lengths)):
            record = {"input_ids": input_ids[b].cpu()[am[b]][:n].to(torch.int64),
                      "loss_mask": (loss_mask[b].cpu()[am[b]][:n] != 0).to(torch.uint8)}
            if aux is not None:
                record["aux_hidden"] = _to_host(aux[i].contiguous())
            record["last_hidden"] = _to_host(last[i].contiguous())
            records.append(record)
        event = copies_done_event(feats.last_hidden.device) if records else None
        return CapturedRows(records, int(policy_version), plan.counts, event)


def _concat_passes(passes: list[CapturedFeatures], batch_shape: tuple[int, ...]) -> CapturedFeatures:
    """Micro-batch forwards of one [B, T] batch, in order, as one: padded passes ([b_i, T, ...])
    concatenate on dim 0, remove-padding passes ([1, nnz_i, ...]) on dim 1."""
    if len(passes) == 1:
        return passes[0]
    b, t = batch_shape
    assert all(p.last_hidden is not None for p in passes)
    shapes = [p.last_hidden.shape for p in passes if p.last_hidden is not None]
    padded = all(s[1] == t for s in shapes) and sum(s[0] for s in shapes) == b
    if not padded and not all(s[0] == 1 for s in shapes):
        raise ValueError(f"collect: passes of shapes {[tuple(s) for s in shapes]} are neither padded micro-batches "
                         f"of the [{b}, {t}] batch nor remove-padding [1, nnz] passes")
    dim = 0 if padded else 1
    hidden = {i: torch.cat([p.hidden[i] for p in passes], dim) for i in passes[0].layer_ids}
    last = torch.cat([p.last_hidden for p in passes if p.last_hidden is not None], dim)
    return CapturedFeatures(passes[0].layer_ids, hidden, last)
