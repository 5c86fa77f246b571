"""Turn logits into the distribution a sampler draws from: temperature, top-k, top-p (vLLM order).
Temperature 0 is greedy (one-hot at the argmax, lowest id on ties). logits [..., V] -> probs [..., V] float32."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature: got {self.temperature}, expected >= 0")
        if self.top_k < 0:
            raise ValueError(f"top_k: got {self.top_k}, expected >= 0 (0 = off)")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p: got {self.top_p}, expected in (0, 1]")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def logits_to_probs(logits: Tensor, params: SamplingParams) -> Tensor:
    """[..., V] logits -> [..., V] float32 probabilities after temperature, top-k, top-p."""
    logits = logits.float()
    if params.greedy:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    logits = logits / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, dim=-1, descending=True)
        before = sorted_p.cumsum(-1) - sorted_p  # mass strictly before each token
        keep_sorted = before < params.top_p  # smallest prefix reaching top_p (always >= 1 token)
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        probs = probs * keep
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: Tensor, generator: torch.Generator | None = None) -> Tensor:
    """Draw one id per row: probs [..., V] -> int64 [...]."""
    flat = probs.reshape(-1, probs.shape[-1])
    return torch.multinomial(flat, 1, generator=generator).reshape(probs.shape[:-1])


class ChainDraws:
    """The draft tokens of one chain, drawn position by position, with the distribution q each was
    drawn from when sampling: `stacked()` -> tokens [k] int64, probs [k, V] (None when greedy)."""

    def __init__(self, sampling: SamplingParams, generator: torch.Generator | None = None):
        self.sampling, self.generator = sampling, generator
        self.tokens: list[Tensor] = []
        self.probs: list[Tensor] = []

    def draw(self, logits: Tensor) -> Tensor:
        """The next draft token from one position's logits [V] (any float dtype): int64 [] on their device."""
        if self.sampling.greedy:
            token = logits.argmax()
        else:
            q = logits_to_probs(logits, self.sampling)
            token = sample(q, self.generator)
            self.probs.append(q)
        self.tokens.append(token)
        return token

    def stacked(self) -> tuple[Tensor, Tensor | None]:
        """tokens [K] int64 and probs [K, V] float32 (None when greedy), on the CPU."""
        probs = torch.stack(self.probs).cpu() if self.probs else None
        return torch.stack(self.tokens).long().cpu(), probs
