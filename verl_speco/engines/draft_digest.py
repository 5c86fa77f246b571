"""What a vLLM worker really serves as its draft: a digest of the draft's own live tensors.

Why: vLLM's level-2 sleep (verl's hybrid rollout on GPU) discards the draft's weights too, verl's
weight sync restores only the target, and vLLM's wake-up does not reload the draft
(vllm-project/vllm#52479): outputs stay correct while acceptance silently drops to zero. The trainer
compares this digest after every wake-up with the one taken when the version was loaded
(`verl_integration/served_draft.py`). `DraftDigestMixin` sits beside `vllm_reload.DraftReloadMixin`;
it covers the draft's parameters and buffers (non-persistent ones included) and P-EAGLE's mask-slot
state, never a tensor shared with the target."""

from __future__ import annotations

import hashlib
from typing import Any

import torch

DIGEST_METHOD = "speco_draft_digest"
MASK_STATE = "drafter.parallel_drafting_hidden_state_tensor"  # what P-EAGLE's proposer puts at mask slots


def tensor_digest(tensor: torch.Tensor) -> str:
    """sha256 (hex, first 16 chars) of a tensor's bytes, dtype and shape included."""
    t = tensor.detach().cpu().contiguous()
    h = hashlib.sha256(f"{t.dtype}{tuple(t.shape)}".encode())
    h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def own_draft_tensors(draft: torch.nn.Module, target: torch.nn.Module | None,
                      proposer: Any = None) -> dict[str, torch.Tensor]:
    """The draft's parameters and buffers (by name, duplicates once) that are not target tensors,
    plus the proposer's P-EAGLE mask-slot state when it has one."""
    shared = set() if target is None else {id(t) for t in (*target.parameters(), *target.buffers())}
    out = {name: t for name, t in (*draft.named_parameters(), *draft.named_buffers()) if id(t) not in shared}
    mask_state = getattr(proposer, "parallel_drafting_hidden_state_tensor", None)
    if isinstance(mask_state, torch.Tensor):
        out[MASK_STATE] = mask_state
    return out


def digest_answer(version: int, tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    """{"version", "digest" (over every name and tensor digest, sorted), "tensors": {name: tensor digest}}."""
    per = {name: tensor_digest(t) for name, t in sorted(tensors.items())}
    whole = hashlib.sha256("\n".join(f"{n} {d}" for n, d in per.items()).encode()).hexdigest()
    return {"version": int(version), "digest": whole, "tensors": per}


class DraftDigestMixin:
    """vLLM worker-extension method `speco_draft_digest()` (called through `collective_rpc`)."""

    model_runner: Any

    def speco_draft_digest(self) -> dict[str, Any]:
        """The digest of the draft this worker serves now, and the version it holds (-1: start-up draft)."""
        proposer = self._speco_drafter()  # type: ignore[attr-defined]  # DraftReloadMixin's
        version = self.speco_draft_version()  # type: ignore[attr-defined]
        return digest_answer(version, own_draft_tensors(proposer.model, getattr(self.model_runner, "model", None),
                                                        proposer))
