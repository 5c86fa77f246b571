"""Step times on paper for a GPU the project has not run on: a roofline of the verification and draft
forwards as a `StepTimes` (`benchmarks/device_checks_speculation.py` replaces the paper figures with
measured ones). A forward costs max(bytes / bandwidth, FLOPs / FLOP/s) plus a launch cost."""

from __future__ import annotations

from dataclasses import dataclass

from verl_speco.speculation.cost_model import StepTimes


@dataclass(frozen=True)
class Hardware:
    name: str
    bytes_per_s: float  # achieved memory bandwidth
    flops: float  # achieved dense bf16 FLOP/s
    step_overhead_s: float = 0.8e-3  # scheduler, sampling, launches per engine step (CUDA graphs)
    forward_overhead_s: float = 0.15e-3  # per draft forward (a graph launch and its small kernels)


# datasheet peaks (NVIDIA H100 SXM5: 3.35 TB/s HBM3, 989 TFLOP/s dense BF16; H200 SXM: 4.8 TB/s HBM3e, the
# same compute) at the achieved fractions assumed here: 80% of the bandwidth, 60% of the FLOP/s
H100 = Hardware("H100 SXM (paper)", 0.8 * 3.35e12, 0.6 * 989e12)
H200 = Hardware("H200 SXM (paper)", 0.8 * 4.8e12, 0.6 * 989e12)


@dataclass(frozen=True)
class Forward:
    """What one forward reads and computes: weights read (bytes), parameters used per token, KV bytes
    per context token, and attention width (layers x heads x head_dim) for its FLOPs."""

    weight_bytes: float
    params_per_token: float
    kv_bytes_per_token: float
    attn_width: float

    def seconds(self, hw: Hardware, tokens: int, batch: int, context: int) -> float:
        moved = self.weight_bytes + batch * context * self.kv_bytes_per_token
        work = tokens * (2 * self.params_per_token + 4 * self.attn_width * context)
        return max(moved / hw.bytes_per_s, work / hw.flops)


def qwen3_layer_params(hidden: int = 4096, heads: int = 32, kv_heads: int = 8, head_dim: int = 128,
                       intermediate: int = 12288) -> int:
    attn = hidden * head_dim * (2 * heads + 2 * kv_heads)
    return attn + 3 * hidden * intermediate


# Qwen3-8B: 36 layers of 4096 (32 heads, 8 KV heads of 128), MLP 12288, untied vocabulary 151,936, bf16.
# The embedding gather reads one row per token, so its table is not counted as read.
_LAYER = qwen3_layer_params()
QWEN3_8B = Forward(weight_bytes=2 * (36 * _LAYER + 151936 * 4096), params_per_token=36 * _LAYER + 151936 * 4096,
                   kv_bytes_per_token=36 * 2 * 8 * 128 * 2, attn_width=36 * 32 * 128)
# EAGLE-3 at Qwen3-8B: one layer, fc from 3 x 4096, a draft vocabulary of 32,000 (the released drafts')
EAGLE3_QWEN3_8B = Forward(weight_bytes=2 * (_LAYER + 3 * 4096 * 4096 + 32000 * 4096),
                          params_per_token=_LAYER + 3 * 4096 * 4096 + 32000 * 4096,
                          kv_bytes_per_token=2 * 8 * 128 * 2, attn_width=32 * 128)
# DFlash at Qwen3-8B (the recipe's 5 layers, block 16): the target's LM head (151,936) on every block slot
DFLASH_QWEN3_8B = Forward(weight_bytes=2 * (5 * _LAYER + 151936 * 4096), params_per_token=5 * _LAYER + 151936 * 4096,
                          kv_bytes_per_token=5 * 2 * 8 * 128 * 2, attn_width=5 * 32 * 128)


def draft_forwards(family: str, k: int) -> list[int]:
    """Query tokens per request of each draft forward in a round of k: a chain's first forward over k + 1
    tokens then k - 1 of one (k = 0 keeps the first), a block drafter's one forward over k + 1."""
    if family == "dflash":
        return [k + 1]
    if family == "eagle3":
        return [k + 1] + [1] * max(k - 1, 0)
    raise ValueError(f"family: got {family!r}, expected 'eagle3' or 'dflash'")


def paper_step_times(hw: Hardware, target: Forward, draft: Forward, family: str, batch_sizes: list[int],
                     k_max: int, context: int, prompt: int) -> StepTimes:
    """StepTimes of a drafting engine on `hw` at a mean context of `context` tokens and prompts of
    `prompt` tokens (prefill: every prompt of the batch in one forward)."""
    def verify(b: int, k: int) -> float:
        return target.seconds(hw, b * (k + 1), b, context) + hw.step_overhead_s

    def drafting(b: int, k: int) -> float:
        return sum(draft.seconds(hw, b * n, b, context) + hw.forward_overhead_s for n in draft_forwards(family, k))

    plain = tuple(verify(b, 0) for b in batch_sizes)
    rows = tuple(tuple(verify(b, k) + drafting(b, k) for b in batch_sizes) for k in range(k_max + 1))
    prefill = tuple(target.seconds(hw, b * prompt, b, prompt) + hw.step_overhead_s for b in batch_sizes)
    draft_prefill = tuple(p + draft.seconds(hw, b * prompt, b, prompt) for p, b in zip(prefill, batch_sizes))
    return StepTimes(tuple(batch_sizes), plain, rows, prefill, draft_prefill)
