"""SGLang rollout capture: the target's hidden states returned with each generated sequence.

No sglang import (the server is reached over HTTP or by verl's in-process server). Plain capture
(`return_hidden_states`, every release) gives the post-norm last hidden state; aux capture (0.5.23
only) gives the aux layers instead, loads no draft, and takes SGLang's layer ids = internal - 1
(`drafters.common.layer_ids`). A sequence of P prompt and n generated tokens has P + n - 1 rows;
one with fewer (speculative decoding up to 0.5.12, a radix-cache hit) is dropped and counted, never
aligned by guessing. SGLang's side, release by release: docs/design/engines.md section 4.11."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from drafters.common.layer_ids import check_servable_aux_ids, to_engine_layer_ids
from feature_store import Layout

SGLANG_LAYER_KEY = "sglang.return_aux_hidden_state_layer_ids"
PLAIN_RELEASES = ("0.5.12", "0.5.23")  # releases checked to have --enable-return-hidden-states
AUX_RELEASES = ("0.5.23",)  # releases checked to have --enable-return-aux-hidden-states (0.5.12 lacks it)
CONVENTIONS = {"eagle3": "EAGLE3", "dflash": "DFLASH", "domino": "DFLASH", "dspark": "DSPARK"}
DROP_REASONS = ("rollout_short_decode", "rollout_short_prefill", "rollout_bad_rows")


class RolloutCaptureRefused(ValueError):
    """The rollout cannot give this family's features; the message says why."""


@dataclass(frozen=True)
class RolloutCapturePlan:
    """What the SGLang server runs with and what its rows carry.

    mode "plain": rows carry `last_hidden` [T, H] (layout: no layer ids, post-norm last hidden);
    mode "aux": rows carry `aux_hidden` [T, k*H] at `layout.layer_ids` (no last hidden)."""

    family: str
    mode: str
    layout: Layout
    sglang_layer_ids: tuple[int, ...] = ()
    convention: str | None = None

    def server_args(self) -> dict[str, Any]:
        """SGLang `ServerArgs` field names -> values (the CLI flag is `--` + name with `-`)."""
        if self.mode == "plain":
            return {"enable_return_hidden_states": True}
        return {"enable_return_aux_hidden_states": True, "speculative_algorithm": self.convention,
                "return_aux_hidden_state_layer_ids": list(self.sglang_layer_ids)}

    def cli_flags(self) -> list[str]:
        out: list[str] = []
        for key, value in self.server_args().items():
            flag = "--" + key.replace("_", "-")
            out += [flag] if value is True else [flag, *(str(v) for v in value)] if isinstance(value, list) \
                else [flag, str(value)]
        return out

    @staticmethod
    def request_fields() -> dict[str, Any]:
        """Added to every generate request (`GenerateReqInput.return_hidden_states`)."""
        return {"return_hidden_states": True}

    def field(self) -> str:
        return "last_hidden" if self.mode == "plain" else "aux_hidden"

    def width(self, hidden_size: int) -> int:
        return hidden_size * max(1, len(self.layout.layer_ids))


def plan_rollout_capture(family: str, layout: Layout, required_fields: Sequence[str], num_layers: int,
                         sglang_version: str, serves_draft: bool) -> RolloutCapturePlan:
    """The capture SGLang `sglang_version` can run for `family` (its `required_layout` and
    `required_fields`), or `RolloutCaptureRefused` naming the reason. `serves_draft`: the rollout
    also serves a draft (online mode), which aux capture cannot."""
    where = f"rollout capture of {family!r} on SGLang {sglang_version}"
    needs_aux = "aux_hidden" in required_fields and bool(layout.layer_ids)
    needs_last = "last_hidden" in required_fields
    if layout.convention != "hf_hidden_states":
        raise RolloutCaptureRefused(f"{where}: layout convention {layout.convention!r}, expected 'hf_hidden_states'")
    if needs_aux and needs_last:
        raise RolloutCaptureRefused(
            f"{where}: the family reads aux_hidden {list(layout.layer_ids)} and last_hidden; SGLang returns "
            "either the post-norm last hidden (plain) or the aux layers (--enable-return-aux-hidden-states), "
            "never both")
    if needs_last:
        if layout.last_hidden != "post_norm":
            raise RolloutCaptureRefused(f"{where}: last_hidden {layout.last_hidden!r}, SGLang returns 'post_norm'")
        if sglang_version not in PLAIN_RELEASES:
            raise RolloutCaptureRefused(f"{where}: --enable-return-hidden-states was checked on SGLang "
                                        f"{list(PLAIN_RELEASES)} only")
        return RolloutCapturePlan(family, "plain", Layout(layer_ids=(), last_hidden="post_norm"))
    if not needs_aux:
        raise RolloutCaptureRefused(f"{where}: the family reads neither aux_hidden nor last_hidden")
    if family not in CONVENTIONS:
        raise RolloutCaptureRefused(f"{where}: no SGLang aux-capture convention for it (have {sorted(CONVENTIONS)})")
    if sglang_version not in AUX_RELEASES:
        raise RolloutCaptureRefused(f"{where}: --enable-return-aux-hidden-states exists in SGLang "
                                    f"{list(AUX_RELEASES)} (checked; 0.5.12 lacks it)")
    if serves_draft:
        raise RolloutCaptureRefused(f"{where}: --enable-return-aux-hidden-states loads no draft, and this "
                                    "rollout serves the draft being trained (mode=online); use collect_only")
    try:
        ids = check_servable_aux_ids(layout.layer_ids, num_layers)
    except ValueError as e:
        raise RolloutCaptureRefused(f"{where}: {e}") from None
    return RolloutCapturePlan(family, "aux", Layout(layer_ids=ids, last_hidden="none"),
                              to_engine_layer_ids(ids, SGLANG_LAYER_KEY, num_layers), CONVENTIONS[family])


def _entry(value: Any, width: int) -> Tensor | str:
    """One `meta_info["hidden_states"]` entry as [rows, width] float32, or a drop reason."""
    try:
        t = torch.tensor(value, dtype=torch.float32)
    except (TypeError, ValueError):
        return "rollout_bad_rows"
    if t.dim() == 1:
        t = t.unsqueeze(0)
    if t.dim() != 2 or t.shape[1] != width or not torch.isfinite(t).all():
        return "rollout_bad_rows"
    return t


def hidden_rows(meta_info: Mapping[str, Any], prompt_len: int, num_output: int, width: int) -> Tensor | str:
    """The rows [prompt_len + num_output - 1, width] of one response's `meta_info["hidden_states"]`
    (module docstring), or the drop reason (`DROP_REASONS`) when they cannot be aligned:
    prefill entries are the leading 2-D ones, decode entries the 1-D ones after them."""
    entries = meta_info.get("hidden_states")
    if not isinstance(entries, list) or not entries:
        return "rollout_bad_rows"
    prefill: list[Tensor] = []
    decode: list[Tensor] = []
    for value in entries:
        is_matrix = isinstance(value, list) and bool(value) and isinstance(value[0], list)
        if is_matrix and decode:
            return "rollout_bad_rows"  # a prefill chunk after decode rows: not SGLang's order
        t = _entry(value, width)
        if isinstance(t, str):
            return t
        (prefill if is_matrix else decode).append(t)
    prefill_rows = sum(int(t.shape[0]) for t in prefill)
    if prefill_rows != prompt_len:
        return "rollout_short_prefill" if prefill_rows < prompt_len else "rollout_bad_rows"
    if len(decode) != num_output - 1:
        return "rollout_short_decode" if len(decode) < num_output - 1 else "rollout_bad_rows"
    return torch.cat(prefill + decode, dim=0)  # [prompt_len + num_output - 1, width]
