"""EAGLE-2 drafter configuration (docs/design/algorithms.md section 2): the EAGLE-1 settings plus the tree shape.

EAGLE-2 trains exactly the EAGLE-1 draft (same model, objective, export tensors); only drafting
changes: an EAGLE-2 dynamic tree (drafters/common/tree.py `build_draft_tree`) instead of a chain.
The tree shape is a setting of the drafter (it decides nothing about the weights):

- top_k: nodes expanded per depth and children per expanded node (SafeAILab default 10);
- depth: draft tokens on the longest path (SafeAILab default 7);
- total_tokens: draft nodes kept by the rerank, the root excluded (SafeAILab default 60; SGLang's
  --speculative-num-draft-tokens counts the root, so it is total_tokens + 1).

The defaults are the SafeAILab ones scaled for the embedded tiny target (vocab 512, 8 layers,
hidden 128, trained for minutes): 4 / 4 / 16, i.e. a tree a quarter as wide, deep enough to beat
the quickstart's 3-token chain, and 16 tree tokens per verification pass (SafeAILab: 60) so one
CPU target pass stays short. Pick the SafeAILab values (10, 7, 60) for 7B-class targets.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from drafters.common.target import TargetSpec
from drafters.common.tree import TreeConfig
from drafters.eagle1.config import Eagle1Config


@dataclass(frozen=True)
class Eagle2Config(Eagle1Config):
    """Eagle1Config's training settings (feature_noise, value_weight, prob_weight, attn_backend)
    plus the tree shape of the module docstring (checked by `TreeConfig`: total_tokens at most
    top_k + (depth - 1) * top_k^2)."""

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
