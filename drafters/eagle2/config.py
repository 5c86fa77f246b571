"""EAGLE-2 drafter configuration (docs/design/algorithms.md section 2): EAGLE-1's draft, drafted as a
dynamic tree (drafters/common/tree.py). The tree shape defaults 4 / 4 / 16 suit the tiny embedded
target; use SafeAILab's (10, 7, 60) for 7B-class targets."""

from __future__ import annotations

from dataclasses import dataclass, fields

from drafters.common.target import TargetSpec
from drafters.common.tree import TreeConfig
from drafters.eagle1.config import Eagle1Config


@dataclass(frozen=True)
class Eagle2Config(Eagle1Config):
    """Eagle1Config's settings plus the tree shape (checked by `TreeConfig`)."""

    top_k: int = 4
    depth: int = 4
    total_tokens: int = 16

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.top_k < 2:
            raise ValueError(f"top_k: got {self.top_k}, expected >= 2 (top_k = 1 is the EAGLE-1 chain: use eagle1)")
        self.tree()

    def resolve(self, target_spec: TargetSpec) -> Eagle2Config:
        """EAGLE-1's check (nothing to fill in from the target)."""
        super().resolve(target_spec)
        return self

    def tree(self) -> TreeConfig:
        """The tree shape for `build_draft_tree` / `tree_speculative_generate`."""
        return TreeConfig(int(self.top_k), int(self.depth), int(self.total_tokens))

    def chain_config(self) -> Eagle1Config:
        """The EAGLE-1 settings alone (what an EAGLE-1 reader of an EAGLE-2 export sees)."""
        return Eagle1Config(**{f.name: getattr(self, f.name) for f in fields(Eagle1Config)})


TREE_FIELDS = tuple(f.name for f in fields(Eagle2Config) if f.name not in {g.name for g in fields(Eagle1Config)})
