"""Shared pieces of the training-step benchmark (scripts/bench_train_step.py): the synthetic target
and batches, helpers that build speculators' config objects without downloads, and the adapter
contract (`Adapter`, `Built`, `LossCheck`) that the per-family adapters implement (benchmarks/train_step_eagle3.py,
train_step_dflash.py, train_step_peagle.py; the table: train_step_adapters.py)."""

from __future__ import annotations

import abc
import argparse
import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from drafters.common.target import TargetHead, TargetSpec

NUM_TARGET_LAYERS = 8  # synthetic target depth: only the number of context layers matters here
LOSS_REDUCTION_EPS = 1e-5  # speculators' denominator epsilon (losses.utils._LOSS_REDUCTION_EPS)


def autocast(dtype: str) -> contextlib.AbstractContextManager[object]:
    """bf16: torch.autocast("cpu", bfloat16) around forward + loss (speculators' trainer does the same)."""
    if dtype == "bfloat16":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def tolerance(dtype: str) -> float:
    return 2e-3 if dtype == "float32" else 5e-2


# ----------------------------------------------------------------------------- synthetic data

@dataclass
class Data:
    target: TargetHead
    samples: list[dict[str, Tensor]]  # feature-store samples (ours), T = seq_len each
    pre_norm_last: Tensor  # [B, T, H] pre-final-norm last hidden (speculators applies the norm)


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps))


def make_data(args: argparse.Namespace, num_features: int, lean: float) -> Data:
    """A tiny synthetic target (no hub) and B sequences whose target distribution is peaked on
    the real next token.

    Tokens follow a Zipf law over a random permutation of the vocab; the first `--prompt-frac` of
    each sequence is prompt (loss_mask 0). last_hidden[p] (post-norm) leans towards lm_head[x_{p+1}]
    with weight `lean` against unit noise; aux_hidden is noise [T, num_features * H]. The target's
    MASK token is the last vocab id. `--frozen-dtype` is the dtype of the target embedding and
    lm_head (the frozen [V, H] tensors; `cast_frozen` casts the models' copies after the build).
    """
    g = torch.Generator().manual_seed(args.seed)
    h, v, t = args.hidden, args.vocab, args.seq_len
    spec = TargetSpec(vocab_size=v, hidden_size=h, num_hidden_layers=NUM_TARGET_LAYERS,
                      num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                      head_dim=h // args.heads, intermediate_size=args.intermediate, rope_theta=10000.0,
                      rms_norm_eps=1e-6, max_position_embeddings=max(4096, 2 * t), model_type="llama",
                      tie_word_embeddings=False, mask_token="<|MASK|>", mask_token_id=v - 1)
    frozen = getattr(torch, getattr(args, "frozen_dtype", "float32"))
    embed = (torch.randn(v, h, generator=g) * 0.02).to(frozen)
    target = TargetHead(spec, embed, (torch.randn(v, h, generator=g) * 0.05).to(frozen),
                        1.0 + 0.1 * torch.randn(h, generator=g))
    zipf = 1.0 / (torch.arange(v, dtype=torch.float64) + 2.0)
    token_of_rank = torch.randperm(v, generator=g)
    samples, pre_norm = [], []
    for _ in range(args.batch):
        ids = token_of_rank[torch.multinomial(zipf, t + 1, replacement=True, generator=g)]
        direction = target.lm_head[ids[1:]].float()  # [T, H]: lean position p towards x_{p+1}
        direction = direction / direction.norm(dim=-1, keepdim=True) * math.sqrt(h)
        pre = lean * direction + torch.randn(t, h, generator=g)  # pre-norm last hidden
        loss_mask = (torch.arange(t) >= int(t * args.prompt_frac)).to(torch.uint8)
        samples.append({"input_ids": ids[:t].long(), "loss_mask": loss_mask,
                        "aux_hidden": torch.randn(t, num_features * h, generator=g),
                        "last_hidden": rms_norm(pre, target.final_norm, spec.rms_norm_eps)})
        pre_norm.append(pre)
    return Data(target, samples, torch.stack(pre_norm))


def cast_frozen(model: nn.Module, dtype: str) -> int:
    """Cast every frozen matrix of `model` (parameters without grad, floating buffers, >= 2 dims) to
    `dtype` in place; returns the elements cast. Trainable parameters stay as they are."""
    to, count = getattr(torch, dtype), 0
    with torch.no_grad():
        for p in model.parameters():
            if not p.requires_grad and p.dim() >= 2 and p.is_floating_point() and p.dtype != to:
                p.data = p.data.to(to)
                count += p.numel()
        for module in model.modules():
            for name, buf in list(module._buffers.items()):
                if buf is not None and buf.dim() >= 2 and buf.is_floating_point() and buf.dtype != to:
                    module._buffers[name] = buf.to(to)
                    count += buf.numel()
    return count


def load_exact(model: nn.Module, state: dict[str, Tensor], what: str, may_miss: tuple[str, ...] = ()) -> None:
    """load_state_dict: every key of `state` must land and every parameter / buffer of `model` must
    be set, except `may_miss` (set otherwise); the error names the keys."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if k not in may_miss]
    if missing or unexpected:
        raise RuntimeError(f"{what} weight copy: missing {sorted(missing)}, unexpected {sorted(unexpected)}")


def verifier_config(architecture: str) -> Any:
    from speculators.config import VerifierConfig

    return VerifierConfig(name_or_path=None, architectures=[architecture])


def speculators_config(algorithm: str, speculative_tokens: int) -> Any:
    from speculators.config import SpeculatorsConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig

    return SpeculatorsConfig(algorithm=algorithm, default_proposal_method="greedy",
                             proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=speculative_tokens)],
                             verifier=verifier_config("LlamaForCausalLM" if algorithm == "eagle3"
                                                      else "Qwen3ForCausalLM"))


def layer_config(cls: Any, spec: TargetSpec, num_layers: int) -> Any:
    """An HF decoder-layer config (LlamaConfig / Qwen3Config) with the target's sizes, SDPA attention."""
    cfg = cls(vocab_size=spec.vocab_size, hidden_size=spec.hidden_size, intermediate_size=spec.intermediate_size,
              num_hidden_layers=num_layers, num_attention_heads=spec.num_attention_heads,
              num_key_value_heads=spec.num_key_value_heads, head_dim=spec.head_dim,
              rms_norm_eps=spec.rms_norm_eps, rope_theta=spec.rope_theta,
              max_position_embeddings=spec.max_position_embeddings, attention_bias=False)
    cfg._attn_implementation = "sdpa"
    return cfg


# ----------------------------------------------------------------------------- the adapter contract

@dataclass
class LossCheck:
    ok: bool
    ours: float  # our loss on the check batch (the family's own normalisation)
    theirs: float  # speculators' loss on the same rows


@dataclass
class Built:
    """One family, both sides, ready to time. `*_loss()` = forward + loss (autocast inside)."""

    ours: nn.Module
    theirs: nn.Module
    ours_loss: Callable[[], Tensor]
    theirs_loss: Callable[[], Tensor]
    check: Callable[[], LossCheck]
    header: str  # the family's shapes, one line
    loss_names: tuple[str, str]  # what each side's loss is, e.g. ("soft CE", "KL")


class Adapter(abc.ABC):
    """A family adapter: `name` (the --family value), `label`, `validate`, `build`."""

    name: ClassVar[str]
    label: ClassVar[str]

    @abc.abstractmethod
    def validate(self, args: argparse.Namespace) -> list[tuple[str, object, str]]:
        """(flag, value, expected) for every family-specific flag that does not fit."""

    @abc.abstractmethod
    def build(self, args: argparse.Namespace) -> Built:
        """Both sides at the shapes of `args`, our weights copied into speculators'."""

    @abc.abstractmethod
    def our_config(self, args: argparse.Namespace) -> Any:
        """Our family's config at the shapes of `args` (SDPA attention; also scripts/gpu_check.py's)."""


def label_agreement(data: Data, batch: dict[str, Tensor]) -> tuple[int, int]:
    """(positions p with argmax(target logits at p) == x_{p+1}, loss positions p + 1 counted)."""
    logits = batch["last_hidden"][:, :-1].float() @ data.target.lm_head.float().T  # [B, T-1, V]
    nxt = batch["input_ids"][:, 1:]
    mask = (batch["loss_mask"].to(torch.bool) & batch["attention_mask"].to(torch.bool))[:, 1:]
    hit = (logits.argmax(-1) == nxt) & mask
    return int(hit.sum()), int(mask.sum())
