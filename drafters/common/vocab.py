"""Reduced draft vocabulary (EAGLE-3 / P-EAGLE): the `Vd` most frequent target tokens over loss-masked
positions, sorted by target id (SafeAILab `scandata`), and the maps `d2t [Vd]` int64 OFFSETS
(target_id = draft_id + d2t[draft_id], as both engines compute it) and `t2d [V]` bool. Worked example,
counts [0, 5, 0, 9, 9, 1], Vd = 3: kept [1, 3, 4], d2t = [1, 2, 2], t2d = [F, T, F, T, T, F]."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor


def token_counts(input_ids: Tensor, loss_mask: Tensor, vocab_size: int) -> Tensor:
    """Counts of each target id over positions with loss_mask == 1: any shape -> int64 [V]."""
    ids = input_ids.reshape(-1).long()[loss_mask.reshape(-1).to(torch.bool)]
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise ValueError(f"input_ids: values in [{int(ids.min())}, {int(ids.max())}], expected [0, {vocab_size})")
    return torch.bincount(ids, minlength=vocab_size)


def token_counts_from_samples(samples: Iterable[Mapping[str, Tensor]], vocab_size: int) -> Tensor:
    """Sum of `token_counts` over feature-store samples (`input_ids`, `loss_mask`); must be finite."""
    total = torch.zeros(vocab_size, dtype=torch.int64)
    for sample in samples:
        total += token_counts(sample["input_ids"], sample["loss_mask"], vocab_size)
    return total


def vocab_map_problems(d2t: Tensor, t2d: Tensor | None, vocab_size: int) -> list[str]:
    """Why (d2t, t2d) is not a valid draft vocab map of a `vocab_size` target (empty: valid), the one place
    this rule lives: draft ids map to strictly increasing target ids in [0, V), t2d marks exactly them."""
    if d2t.dtype != torch.int64:
        return [f"d2t: dtype {d2t.dtype}, expected torch.int64 offsets"]
    targets = torch.arange(d2t.numel()) + d2t
    if targets.numel() and (int(targets.min()) < 0 or int(targets.max()) >= vocab_size):
        return [f"d2t: target ids i + d2t[i] span [{int(targets.min())}, {int(targets.max())}], expected within "
                f"[0, {vocab_size}); was d2t stored as ids instead of offsets?"]
    if targets.numel() > 1 and not bool((targets[1:] > targets[:-1]).all()):
        return ["d2t: target ids i + d2t[i] are not strictly increasing (the draft vocab is the sorted list of "
                "kept target ids)"]
    if t2d is not None:
        if t2d.dtype != torch.bool or tuple(t2d.shape) != (vocab_size,):
            return [f"t2d: got {t2d.dtype} {tuple(t2d.shape)}, expected torch.bool ({vocab_size},)"]
        if int(t2d.sum()) != d2t.numel() or not bool(t2d[targets].all()):
            return ["t2d: does not mark exactly the targets i + d2t[i] of the draft vocab"]
    return []


def check_vocab_map(d2t: Tensor, t2d: Tensor | None, vocab_size: int) -> None:
    """`vocab_map_problems` as a ValueError."""
    problems = vocab_map_problems(d2t, t2d, vocab_size)
    if problems:
        raise ValueError("; ".join(problems))


@dataclass
class DraftVocab:
    """d2t: int64 [Vd] offsets (target = draft + d2t[draft]); t2d: bool [V]."""

    d2t: Tensor
    t2d: Tensor

    def __post_init__(self) -> None:
        check_vocab_map(self.d2t, self.t2d, int(self.t2d.numel()))

    @classmethod
    def identity(cls, vocab_size: int) -> DraftVocab:
        return cls(torch.zeros(vocab_size, dtype=torch.int64), torch.ones(vocab_size, dtype=torch.bool))

    @classmethod
    def from_target_ids(cls, target_ids: Tensor, vocab_size: int) -> DraftVocab:
        used = torch.sort(target_ids.long()).values
        t2d = torch.zeros(vocab_size, dtype=torch.bool)
        t2d[used] = True
        return cls(used - torch.arange(used.numel()), t2d)

    @classmethod
    def select(cls, counts: Tensor, draft_vocab_size: int) -> DraftVocab:
        """The `draft_vocab_size` most frequent ids of `counts [V]` (ties -> lower id)."""
        vocab_size = counts.numel()
        if not 0 < draft_vocab_size <= vocab_size:
            raise ValueError(f"draft_vocab_size: got {draft_vocab_size}, expected 1..{vocab_size}")
        order = torch.sort(-counts.long(), stable=True).indices  # most frequent first, lower id on ties
        return cls.from_target_ids(order[:draft_vocab_size], vocab_size)

    @property
    def draft_size(self) -> int:
        return self.d2t.numel()

    @property
    def vocab_size(self) -> int:
        return self.t2d.numel()

    @property
    def is_full(self) -> bool:
        return self.draft_size == self.vocab_size

    @property
    def target_ids(self) -> Tensor:
        """int64 [Vd]: the target id of each draft id."""
        return torch.arange(self.d2t.numel(), device=self.d2t.device) + self.d2t

    def draft_to_target(self, draft_ids: Tensor) -> Tensor:
        return draft_ids + self.d2t[draft_ids]

    def target_to_draft(self, target_ids: Tensor) -> Tensor:
        """Draft id of each target id, -1 where the target id is not in the draft vocab."""
        lookup = torch.full((self.vocab_size,), -1, dtype=torch.int64, device=self.d2t.device)
        lookup[self.target_ids] = torch.arange(self.draft_size, device=self.d2t.device)
        return lookup[target_ids]

    def export_tensors(self) -> dict[str, Tensor]:
        """{'d2t', 't2d'} for a reduced vocab; {} when Vd == V (engines then use identity)."""
        return {} if self.is_full else {"d2t": self.d2t.clone(), "t2d": self.t2d.clone()}


def target_logits_to_draft(target_logits: Tensor, t2d: Tensor) -> Tensor:
    """[..., V] -> [..., Vd]: the target logits of the draft-vocab tokens, in draft-id order."""
    return target_logits[..., t2d]


def draft_logits_to_target(draft_logits: Tensor, d2t: Tensor, vocab_size: int) -> Tensor:
    """[..., Vd] -> [..., V]: scatter to target ids, -inf elsewhere (vLLM `compute_logits`)."""
    target_ids = torch.arange(d2t.numel(), device=d2t.device) + d2t
    out = draft_logits.new_full((*draft_logits.shape[:-1], vocab_size), float("-inf"))
    out[..., target_ids] = draft_logits
    return out
