"""`drafter.capture_source`: rows from the rollout engine's returned hidden states (SGLang), chosen once
per run (`choose_capture_source`). A response has hidden states for all but its last token, so its row is
the sequence without it. Worked example, prompt [a, b, c], output [d, e, f]:
    row input_ids [a, b, c, d, e]    loss_mask [0, 0, 0, 1, 1]    hidden [5, D]"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from safetensors.torch import load as safetensors_load
from safetensors.torch import save as safetensors_save

from drafters.common.target import TargetSpec
from verl_speco.engines.sglang_capture import (
    DROP_REASONS,
    RolloutCapturePlan,
    RolloutCaptureRefused,
    hidden_rows,
    plan_rollout_capture,
)
from verl_speco.online.capture import CapturedRows, plan_rows, safetensors_metadata
from verl_speco.online.config import CaptureCaps, DrafterConfigError, DrafterRunConfig

logger = logging.getLogger(__name__)


def choose_capture_source(cfg: DrafterRunConfig, engine: str, family: Any, family_cfg: Any, spec: TargetSpec,
                          sglang_version: str | None) -> RolloutCapturePlan | None:
    """The rollout capture plan, or None for actor capture (see the module docstring)."""
    if cfg.capture_source == "actor":
        return None
    try:
        if engine != "sglang":
            raise RolloutCaptureRefused(f"rollout capture needs actor_rollout_ref.rollout.name=sglang, got {engine!r}")
        if sglang_version is None:
            raise RolloutCaptureRefused("rollout capture: SGLang's version is unknown (is sglang installed?)")
        if cfg.mode == "online" and cfg.capture_pass != "old_logprob":
            raise RolloutCaptureRefused(
                f"the rollout returns the hidden states of the policy that generated it, i.e. capture_pass="
                f"old_logprob; capture_pass={cfg.capture_pass!r} needs the updated actor's forward")
        return plan_rollout_capture(cfg.family, family.required_layout(family_cfg, spec),
                                    family.required_fields(family_cfg), spec.num_hidden_layers, sglang_version,
                                    serves_draft=cfg.mode == "online")
    except RolloutCaptureRefused as e:
        if cfg.capture_source == "rollout":
            raise DrafterConfigError(f"actor_rollout_ref.rollout.drafter.capture_source: got 'rollout', but {e}; "
                                     "set capture_source=actor (or auto to fall back)") from None
        logger.warning("drafter capture_source=auto: capturing from the actor; %s", e)
        return None


@dataclass(frozen=True)
class RolloutResponse:
    """One generated sequence: prompt token ids, SGLang's `output_ids` and `meta_info`."""

    prompt_ids: Sequence[int]
    output_ids: Sequence[int]
    meta_info: Mapping[str, Any]


class RolloutCapture:
    """Rollout responses -> `CapturedRows` under `caps` (seeded like `OnlineCapture`)."""

    def __init__(self, plan: RolloutCapturePlan, hidden_size: int, caps: CaptureCaps, seed: int = 0,
                 hidden_dtype: torch.dtype = torch.bfloat16):
        self.plan, self.hidden_size, self.caps, self.seed = plan, int(hidden_size), caps, int(seed)
        self.hidden_dtype = hidden_dtype

    def rows(self, responses: Sequence[RolloutResponse], policy_version: int) -> CapturedRows:
        """Align every response's hidden states (`hidden_rows`), then keep rows under the caps."""
        width = self.plan.width(self.hidden_size)
        return self.rows_from_aligned([align_response(r, width) for r in responses], policy_version)

    def encode(self, response: RolloutResponse) -> bytes:
        """One response aligned where it was generated (the agent loop), as safetensors bytes (input_ids [T]
        int64, hidden [T, D], prompt_len), or only the drop reason when it cannot be aligned."""
        got = align_response(response, self.plan.width(self.hidden_size))
        if isinstance(got, str):
            return safetensors_save({}, metadata={"drop": got})
        ids, mask, hidden = got
        return safetensors_save({"input_ids": ids, "hidden": hidden.to(self.hidden_dtype).contiguous()},
                                metadata={"prompt_len": str(int((mask == 0).sum()))})

    def rows_from_encoded(self, entries: Sequence[bytes], policy_version: int) -> CapturedRows:
        """`rows` of responses `encode`d elsewhere; an entry that is not such bytes is refused
        (`RolloutEntryError`, naming the entry) rather than guessed at."""
        return self.rows_from_aligned([self._decode(i, e) for i, e in enumerate(entries)], policy_version)

    def _decode(self, index: int, entry: bytes) -> Aligned | str:
        width = self.plan.width(self.hidden_size)
        where = f"rollout capture entry {index}"
        if not isinstance(entry, bytes | bytearray):
            raise RolloutEntryError(f"{where}: got {type(entry).__name__}, expected safetensors bytes from the "
                                    "capture agent loop")
        try:
            meta = safetensors_metadata(bytes(entry))
            tensors = safetensors_load(bytes(entry))
        except Exception as e:  # noqa: BLE001 - any parse failure is one refusal naming the entry
            raise RolloutEntryError(f"{where}: not a safetensors buffer ({e})") from None
        if "drop" in meta:
            if meta["drop"] not in DROP_REASONS or tensors:
                raise RolloutEntryError(f"{where}: drop reason {meta['drop']!r}, expected one of {list(DROP_REASONS)}")
            return meta["drop"]
        ids, hidden = tensors.get("input_ids"), tensors.get("hidden")
        prompt_len = int(meta.get("prompt_len", -1)) if str(meta.get("prompt_len", "")).isdigit() else -1
        if ids is None or hidden is None or ids.dtype != torch.int64 or ids.dim() != 1 \
                or tuple(hidden.shape) != (ids.numel(), width) or not 0 < prompt_len <= ids.numel() \
                or not hidden.is_floating_point():
            shapes = {k: (str(v.dtype), tuple(v.shape)) for k, v in tensors.items()}
            raise RolloutEntryError(f"{where}: tensors {shapes}, prompt_len {meta.get('prompt_len')!r}; expected "
                                    f"input_ids int64 [T], hidden [T, {width}], 0 < prompt_len <= T")
        mask = torch.zeros(ids.numel(), dtype=torch.uint8)
        mask[prompt_len:] = 1
        return ids, mask, hidden

    def rows_from_aligned(self, responses: Sequence[Aligned | str], policy_version: int) -> CapturedRows:
        counts = dict.fromkeys(DROP_REASONS, 0)
        aligned: list[Aligned] = []
        for got in responses:
            if isinstance(got, str):
                counts[got] += 1
            else:
                aligned.append(got)
        records: list[dict[str, torch.Tensor]] = []
        plan_counts: dict[str, int] = {"seen": 0}
        if aligned:
            longest = max(int(a[0].numel()) for a in aligned)
            am = torch.zeros(len(aligned), longest, dtype=torch.int64)
            lm = torch.zeros_like(am)
            for b, (ids, mask, _) in enumerate(aligned):
                am[b, : ids.numel()] = 1
                lm[b, : ids.numel()] = mask.to(torch.int64)
            plan = plan_rows(am, lm, self.caps, self.seed + 1_000_003 * int(policy_version))
            plan_counts = plan.counts
            for b, n in zip(plan.rows, plan.lengths):
                ids, mask, hidden = aligned[b]
                records.append({"input_ids": ids[:n], "loss_mask": mask[:n],
                                self.plan.field(): hidden[:n].to(self.hidden_dtype).contiguous()})  # [T, D]
        merged = {**plan_counts, **counts}
        merged["seen"] = plan_counts.get("seen", 0) + sum(counts.values())
        return CapturedRows(records, int(policy_version), merged)


Aligned = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # input_ids [T], loss_mask [T] uint8, hidden [T, D]


class RolloutEntryError(ValueError):
    """An encoded rollout-capture entry that is not what `RolloutCapture.encode` writes."""


def align_response(r: RolloutResponse, width: int) -> Aligned | str:
    """The row of one response (module docstring: its sequence without the last token), or why not."""
    prompt, output = [int(t) for t in r.prompt_ids], [int(t) for t in r.output_ids]
    if not prompt or not output:
        return "rollout_bad_rows"
    got = hidden_rows(r.meta_info, len(prompt), len(output), width)
    if isinstance(got, str):
        return got
    ids = torch.tensor(prompt + output[:-1], dtype=torch.int64)
    mask = torch.zeros(ids.numel(), dtype=torch.uint8)
    mask[len(prompt):] = 1
    return ids, mask, got


def capture_metrics(rows: CapturedRows) -> dict[str, float]:
    """`drafter/capture/<count>` of one capture (rollout drops included), as the trainer logs them."""
    return {f"drafter/capture/{k}": float(v) for k, v in rows.counts.items()}


def collect_from_rollout(client: Any, prompts: Sequence[Sequence[int]], sampling_params: Mapping[str, Any],
                         capture: RolloutCapture, sink: Any, step: int, policy_version: int) -> dict[str, float]:
    """One collect_only step from the rollout: each prompt generated by `client` (an `SGLangHTTPClient`)
    with the plan's request fields, the rows written by `sink` (a `StoreSink`) and committed at `step`."""
    fields = capture.plan.request_fields()
    responses = []
    for prompt in prompts:
        reply = client.generate(list(prompt), sampling_params, **fields)
        responses.append(RolloutResponse(list(prompt), reply["output_ids"], reply["meta_info"]))
    rows = capture.rows(responses, policy_version)
    sink.write(rows, step)
    sink.end_step(step)
    dropped = sum(rows.counts.get(k, 0) for k in DROP_REASONS)
    if dropped:
        logger.warning("rollout capture, step %s: %s of %s responses dropped (%s)", step, dropped, len(responses),
                       {k: rows.counts[k] for k in DROP_REASONS if rows.counts.get(k)})
    return capture_metrics(rows)
