"""Engine acceptance counters: snapshots, per-run deltas, and the derived figures (no engine import).

The formulas live in `drafters.common.metrics.AcceptanceStats` (vLLM's convention): mean acceptance
length = 1 + num_accepted_tokens / num_drafts (1.0 for a never-right draft, 1 + k for a perfect one),
per-position rate i = accepted_per_pos[i] / num_drafts, draft acceptance rate = accepted / drafted
tokens. This module only turns cumulative engine counters into them."""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

from drafters.common.metrics import AcceptanceStats


@dataclass(frozen=True)
class SpecCounters:
    """Cumulative engine counters at one instant; subtract two snapshots for one run's figures."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: tuple[int, ...] = ()

    def __sub__(self, earlier: SpecCounters) -> SpecCounters:
        pairs = itertools.zip_longest(self.accepted_per_pos, earlier.accepted_per_pos, fillvalue=0)
        delta = SpecCounters(
            num_drafts=self.num_drafts - earlier.num_drafts,
            num_draft_tokens=self.num_draft_tokens - earlier.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens - earlier.num_accepted_tokens,
            accepted_per_pos=tuple(a - b for a, b in pairs),
        )
        if min(delta.num_drafts, delta.num_draft_tokens, delta.num_accepted_tokens,
               *delta.accepted_per_pos, 0) < 0:
            raise ValueError(f"counters went backwards ({earlier} -> {self}): the snapshots come from "
                             "different engines (vLLM keeps one metrics registry per process)")
        return delta

    def __add__(self, other: SpecCounters) -> SpecCounters:
        """Counters of two engines together (e.g. the rollout replicas of one RL step)."""
        pairs = itertools.zip_longest(self.accepted_per_pos, other.accepted_per_pos, fillvalue=0)
        return SpecCounters(num_drafts=self.num_drafts + other.num_drafts,
                            num_draft_tokens=self.num_draft_tokens + other.num_draft_tokens,
                            num_accepted_tokens=self.num_accepted_tokens + other.num_accepted_tokens,
                            accepted_per_pos=tuple(a + b for a, b in pairs))

    def to_dict(self) -> dict[str, Any]:
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens, "accepted_per_pos": list(self.accepted_per_pos)}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> SpecCounters:
        return cls(int(d["num_drafts"]), int(d["num_draft_tokens"]), int(d["num_accepted_tokens"]),
                   tuple(int(x) for x in d["accepted_per_pos"]))

    def to_stats(self) -> AcceptanceStats:
        return AcceptanceStats(self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens,
                               list(self.accepted_per_pos))


def acceptance_summary(counters: SpecCounters) -> dict[str, Any]:
    """Raw counters plus the derived figures above (NaN / [] where there was no draft)."""
    stats = counters.to_stats()
    return {
        "num_drafts": stats.num_drafts,
        "num_draft_tokens": stats.num_draft_tokens,
        "num_accepted_tokens": stats.num_accepted,
        "accepted_per_pos": list(stats.accepted_per_pos),
        "mean_acceptance_length": stats.mean_acceptance_length,
        "draft_acceptance_rate": stats.draft_acceptance_rate,
        "per_position_acceptance_rate": stats.per_position_acceptance,
    }
