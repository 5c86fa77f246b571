"""Types shared by every family and by the reference decoder (docs/internals.md, drafters section):
`StoreStats`, the proposer interface (`DraftContext` / `Proposal` / `Proposer`), `EngineFormat` (what a
family ships to the engines) and the `DrafterFamily` protocol with `contract_gaps(family)`."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Protocol

import torch
from torch import Tensor, nn

from drafters.common.losses import ObjectiveOutput
from drafters.common.sampling import SamplingParams, logits_to_probs, sample
from drafters.common.target import TargetHead, TargetSpec
from feature_store import Layout

EXPORT_META_FILE = "verl_speco_meta.json"  # written into every export: {"family": name, "format": ..., ...}


@dataclass(frozen=True)
class StoreStats:
    """token_counts: int64 [V], counts of target ids over loss-masked tokens (see common/vocab.py)."""

    token_counts: Tensor | None = None


@dataclass
class DraftContext:
    """What a proposer sees at the start of a round (one sequence): token_ids int64 [n + 1] (x_n just
    emitted, no features yet); target_hidden_states the HF `hidden_states` (L + 1 of [n, H_t])."""

    token_ids: Tensor
    target_hidden_states: tuple[Tensor, ...]

    def features(self, state_ids: Sequence[int], caller: str = "propose") -> Tensor:
        """The cat of the target hidden states at `state_ids` (HF indices) over positions 0..n-1:
        [n, len(state_ids) * H_t]; ValueError naming `caller` for no context, a bad id or wrong length."""
        n = self.token_ids.numel() - 1
        if n < 1:
            raise ValueError(f"{caller}: need >= 2 committed tokens (the context and the token just emitted), "
                             f"got {n + 1}")
        num = len(self.target_hidden_states)
        for i in state_ids:
            if not 0 <= i < num:
                raise ValueError(f"{caller}: hidden state id {i}: the context has {num} hidden states (0..{num - 1})")
        features = torch.cat([self.target_hidden_states[i] for i in state_ids], dim=-1)
        if features.shape[0] != n:
            raise ValueError(f"target_hidden_states: {features.shape[0]} positions, expected {n} (tokens 0..n-1)")
        return features


@dataclass
class Proposal:
    """token_ids: int64 [k] draft tokens as TARGET ids; probs: float [k, V] the draft
    distribution each was drawn from (target vocab), or None for greedy drafting (q one-hot)."""

    token_ids: Tensor
    probs: Tensor | None

    @classmethod
    def drawn(cls, logits: Tensor, sampling: SamplingParams, generator: torch.Generator | None = None) -> Proposal:
        """The proposal of K slots drafted in one forward from logits [K, V]: the argmax when greedy, else one
        independent sample per slot from q = `logits_to_probs(logits)`, q reported (lossless)."""
        if sampling.greedy:
            return cls(logits.argmax(-1).long().cpu(), None)
        q = logits_to_probs(logits, sampling)  # [K, V]
        return cls(sample(q, generator).long().cpu(), q.cpu())


class Proposer(Protocol):
    def propose(self, ctx: DraftContext, num_tokens: int, sampling: SamplingParams,
                generator: torch.Generator | None = None) -> Proposal:
        """Draft `num_tokens` tokens continuing ctx.token_ids; greedy when `sampling.greedy`."""
        ...


class EngineFormat(Protocol):
    """The engine side of one family's draft; `to_dict()` (JSON naming the family) is how a publish manifest
    tells a rollout server what it receives (`drafters.registry.engine_format_from_dict`)."""

    family: ClassVar[str]

    def to_dict(self) -> dict[str, Any]: ...

    def engine_tensors(self, state_dict: Mapping[str, Tensor], fmt: str = "native",
                       dtype: torch.dtype | None = None) -> dict[str, Tensor]:
        """Training state dict -> the tensors of format `fmt`, checkpoint names, on CPU (export and
        live publish)."""
        ...

    def export(self, state_dict: Mapping[str, Tensor], out_dir: str | Path, fmt: str = "native",
               **kwargs: Any) -> Path: ...

    def vllm_speculative_config(self, draft_dir: str | Path, num_speculative_tokens: int) -> dict[str, Any]:
        """vLLM's `speculative_config` for an export of this format in `draft_dir`."""
        ...

    def sglang_server_args(self, draft_dir: str | Path, num_speculative_tokens: int) -> dict[str, Any]:
        """SGLang's speculative server arguments (`speculative_algorithm`, `..._num_steps`, ...)."""
        ...

    def sglang_expected_shapes(self) -> dict[str, tuple[int, ...]]:
        """Checkpoint name -> shape of every tensor SGLang's draft runner receives live; raises
        `ValueError` naming why when SGLang cannot serve this draft as the function it was trained as."""
        ...

    def sglang_never_published(self) -> Mapping[str, str]:
        """Engine tensors deliberately not sent to SGLang live -> why (e.g. the target's embedding)."""
        ...


class DrafterFamily(Protocol):
    """A catalog entry. `resolve` fills every target-dependent field; `mutable_settings` may change on
    a drafter loaded from an export; `objective(..., progress)` gets the training fraction done in [0, 1]."""

    @property
    def name(self) -> str: ...

    @property
    def config_cls(self) -> type: ...

    @property
    def mutable_settings(self) -> tuple[str, ...]: ...

    def resolve(self, cfg: Any, target_spec: TargetSpec) -> Any: ...

    def config_of(self, model: nn.Module) -> Any:
        """The (resolved) config a model was built with."""
        ...

    def with_settings(self, model: nn.Module, **settings: Any) -> nn.Module:
        """`model` with `mutable_settings` changed (anything else: ValueError naming the keys)."""
        ...

    def build(self, cfg: Any, target: TargetHead, store_stats: StoreStats | None = None) -> nn.Module: ...

    def set_target_head(self, model: nn.Module, embed_tokens: Tensor, lm_head: Tensor) -> None:
        """Point the frozen target pieces at one policy version's embedding [V, H] and LM head [V, H]."""
        ...

    def engine_format(self, cfg: Any, target_spec: TargetSpec) -> EngineFormat: ...

    def format_from_dict(self, data: Mapping[str, Any]) -> EngineFormat: ...

    def load_export(self, export_dir: str | Path, target: TargetHead) -> nn.Module:
        """The trainable model an export (any of the family's formats) of `target` holds, in eval mode."""
        ...

    def required_fields(self, cfg: Any) -> tuple[str, ...]: ...

    def required_layout(self, cfg: Any, target_spec: TargetSpec) -> Layout: ...

    def collate(self, samples: list[dict[str, Tensor]]) -> dict[str, Tensor]: ...

    def objective(self, model: nn.Module, batch: dict[str, Tensor], progress: float = 0.0) -> ObjectiveOutput: ...

    def export(self, model: nn.Module, cfg: Any, target_spec: TargetSpec, out_dir: str | Path,
               fmt: str = "native", **kwargs: Any) -> Path: ...

    def proposer(self, model: nn.Module, target_spec: TargetSpec) -> Proposer: ...


def contract_members() -> tuple[str, ...]:
    """The names every family object has: the members of `DrafterFamily`, in declaration order."""
    return tuple(n for n in vars(DrafterFamily) if not n.startswith("_"))


def contract_gaps(family: object) -> list[str]:
    """What `family` lacks of the contract, by name: missing `DrafterFamily` members, then unset class
    attributes its base declares in `HOOKS`. Empty for a complete family."""
    missing = [n for n in contract_members() if not hasattr(family, n)]
    hooks = getattr(type(family), "HOOKS", ())
    return missing + [n for n in hooks if n not in missing and not hasattr(family, n)]
