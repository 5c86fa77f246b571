"""Deterministic CPU training loop for the embedded target (used by the build and the fine-tune).

Each step draws the next `batch_size` examples of the corpus stream (fresh data every step: no
epochs, no overfitting), renders them with the chat template and trains next-token prediction on the
assistant turn only (its text and the closing `<|im_end|>`): `labels[t] = tokens[t]` where the loss
mask is 1, else -100 (the model shifts labels internally)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from tokenizers import Tokenizer

from verl_speco.target.corpus import Example, iter_examples
from verl_speco.target.tokenizer import EOS_TOKEN, render_chat


@dataclass(frozen=True)
class TrainSpec:
    """Optimisation recipe: AdamW, linear warmup then cosine decay to `min_lr_ratio * lr`.

    `num_threads` is the intra-op thread count training runs with, whatever the caller's setting:
    a CPU kernel may split a reduction by the thread count, so another count may give other
    weights. One thread splits nothing and slows least on a busy machine."""

    steps: int = 600
    batch_size: int = 16
    lr: float = 5e-3
    min_lr_ratio: float = 0.05
    warmup_steps: int = 30
    weight_decay: float = 0.05
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    seed: int = 0
    variant: str = "base"
    num_threads: int = 1

    def __post_init__(self) -> None:
        if self.num_threads < 1:
            raise ValueError(f"num_threads={self.num_threads} must be >= 1")

    def lr_at(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        progress = (step - self.warmup_steps) / max(1, self.steps - self.warmup_steps)
        return self.lr * (self.min_lr_ratio + (1 - self.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


@dataclass
class TrainResult:
    losses: list[float] = field(default_factory=list)
    wall_s: float = 0.0

    @property
    def final_loss(self) -> float:
        """Mean loss of the last 10% of steps (at least one)."""
        tail = self.losses[-max(1, len(self.losses) // 10):]
        return sum(tail) / len(tail)


def encode_example(tok: Tokenizer, ex: Example) -> tuple[list[int], list[int]]:
    """Token ids of the chat-rendered example and its assistant loss mask (see module docstring)."""
    prompt_ids = tok.encode(render_chat(ex.messages[:1], add_generation_prompt=True)).ids
    full_ids = tok.encode(render_chat(ex.messages)).ids
    if full_ids[: len(prompt_ids)] != prompt_ids:
        raise ValueError(f"prompt tokens are not a prefix of the chat tokens for prompt {ex.prompt!r}")
    end = len(full_ids) - 1  # the trailing "\n" after the last <|im_end|>
    if full_ids[end - 1] != tok.token_to_id(EOS_TOKEN):
        raise ValueError(f"expected {EOS_TOKEN} before the final newline for prompt {ex.prompt!r}")
    mask = [0] * len(prompt_ids) + [1] * (end - len(prompt_ids)) + [0]
    return full_ids, mask


def collate(rows: list[tuple[list[int], list[int]]], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad to the longest row: input_ids/attention_mask/labels, each `[batch, seq]`."""
    width = max(len(ids) for ids, _ in rows)
    input_ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), width), dtype=torch.long)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)
    for i, (ids, mask) in enumerate(rows):
        n = len(ids)
        input_ids[i, :n] = torch.tensor(ids)
        attention_mask[i, :n] = 1
        labels[i, :n] = torch.where(torch.tensor(mask, dtype=torch.bool), torch.tensor(ids), -100)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def batches(tok: Tokenizer, spec: TrainSpec, pad_id: int) -> Iterator[dict[str, torch.Tensor]]:
    stream = iter_examples(seed=spec.seed, variant=spec.variant, split="train")
    while True:
        yield collate([encode_example(tok, next(stream)) for _ in range(spec.batch_size)], pad_id)


def set_intra_op_threads(n: int) -> None:
    """Set torch's intra-op thread count to `n` and check that it took.

    Calls the C setter: an in-process vLLM CPU worker replaces `torch.set_num_threads` with a
    function that only logs a warning (vllm/v1/worker/cpu_worker.py, after its thread binding), so
    after any in-process engine the public setter silently keeps vLLM's count, and a build would
    train with whatever thread count that engine chose."""
    torch._C.set_num_threads(n)
    if torch.get_num_threads() != n:
        raise RuntimeError(f"intra-op threads: asked for {n}, torch reports {torch.get_num_threads()}")


def train(
    model: torch.nn.Module,
    tok: Tokenizer,
    spec: TrainSpec,
    pad_id: int,
    log: Callable[[str], None] | None = None,
) -> TrainResult:
    """Train `model` in place for `spec.steps` steps with `spec.num_threads` intra-op threads.

    Bit-identical for a fixed spec and initial model on a given torch build and CPU, whatever the
    machine's load or the caller's thread count (restored afterwards)."""
    prev_threads = torch.get_num_threads()
    set_intra_op_threads(spec.num_threads)
    if log is not None:
        log(f"training with {spec.num_threads} CPU thread(s)")
    torch.manual_seed(spec.seed)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "norm" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "norm" not in n)]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": spec.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=spec.lr, betas=spec.betas, foreach=False,
    )
    result, start = TrainResult(), time.perf_counter()
    model.train()
    try:
        for step, batch in zip(range(spec.steps), batches(tok, spec, pad_id)):
            for group in opt.param_groups:
                group["lr"] = spec.lr_at(step)
            loss = model(**batch).loss
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), spec.grad_clip)
            opt.step()
            result.losses.append(loss.item())
            if log is not None and (step % 50 == 0 or step == spec.steps - 1):
                log(f"step {step:4d}/{spec.steps} loss {loss.item():.4f} lr {spec.lr_at(step):.2e} "
                    f"t {time.perf_counter() - start:.1f}s")
    finally:
        set_intra_op_threads(prev_threads)
        model.eval()
    result.wall_s = time.perf_counter() - start
    return result
