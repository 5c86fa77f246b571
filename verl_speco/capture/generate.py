"""Generate assistant responses with the target itself (drafters learn the target's own outputs).

Batched ``model.generate`` over left-padded prompts. Greedy by default (deterministic); with
``temperature > 0`` it samples from the plain softmax (no top-k/top-p), seeded per batch from
``seed`` so a run is reproducible. A response keeps its end-of-turn token when it produced one;
one that hit ``max_new_tokens`` is kept as is (and counted by the caller)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from drafters.common.tokens import cut_at_end

CPU_MAX_NUM_SEQS = 32  # vLLM sequences at once when `generate_responses_vllm` runs on the CPU


@dataclass
class Generated:
    response_ids: list[int]
    finished: bool            # ended with an end-of-turn token (False: hit max_new_tokens)


def _cut(row: list[int], end_ids: set[int]) -> Generated:
    return Generated(*cut_at_end(row, end_ids))


class FinishedRows:
    """A stopping criterion for HF ``generate`` that stops nothing: it counts the rows whose last token
    is an end token (once per row) and reports each step's newly finished rows to ``on_done(n)``.
    ``input_ids``: [B, T] the prompt and the tokens generated so far; returns [B] all False."""

    def __init__(self, end_ids: Sequence[int], on_done: Callable[[int], None] | None) -> None:
        self.ends = torch.tensor(sorted({int(i) for i in end_ids}), dtype=torch.long)
        self.on_done = on_done
        self.done: torch.Tensor | None = None  # [B] bool
        self.count = 0

    def __call__(self, input_ids: torch.Tensor, scores: Any = None, **kwargs: Any) -> torch.Tensor:
        ended = torch.isin(input_ids[:, -1], self.ends.to(input_ids.device)).cpu()
        self.done = ended if self.done is None else self.done | ended
        new = int(self.done.sum()) - self.count
        if new:
            self.count += new
            if self.on_done is not None:
                self.on_done(new)
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


@torch.no_grad()
def generate_responses(model: nn.Module, prompts: Sequence[Sequence[int]], *, end_ids: Sequence[int],
                       pad_id: int, max_new_tokens: int = 256, temperature: float = 0.0,
                       batch_size: int = 8, seed: int = 0,
                       on_done: Callable[[int], None] | None = None) -> list[Generated]:
    """Responses for token-id prompts, in prompt order. ``end_ids`` stop generation (eos ids).
    ``on_done(n)`` as prompts are answered: each row when it produces an end token (`FinishedRows`,
    during the batch's generation), the rows that hit ``max_new_tokens`` when the batch ends."""
    from transformers import GenerationConfig, StoppingCriteriaList

    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens}: expected >= 1")
    if temperature < 0:
        raise ValueError(f"temperature={temperature}: expected >= 0 (0 = greedy)")
    ends = sorted({int(i) for i in end_ids})
    if not ends:
        raise ValueError("generate_responses: end_ids is empty; the target needs an eos token id")
    sample = temperature > 0
    config = GenerationConfig(
        max_new_tokens=max_new_tokens, do_sample=sample, temperature=temperature if sample else None,
        top_k=0 if sample else None, top_p=1.0 if sample else None, num_beams=1,
        eos_token_id=ends, pad_token_id=pad_id)
    device = next(model.parameters()).device
    hf_model: Any = model                    # an HF GenerationMixin model
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))   # batches pad little
    out: list[Generated | None] = [None] * len(prompts)
    for start in range(0, len(order), batch_size):
        chunk = [list(prompts[i]) for i in order[start: start + batch_size]]
        longest = max(len(p) for p in chunk)
        ids = torch.full((len(chunk), longest), pad_id, dtype=torch.long)
        mask = torch.zeros((len(chunk), longest), dtype=torch.long)
        for b, p in enumerate(chunk):              # left padding: the new tokens line up
            ids[b, longest - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[b, longest - len(p):] = 1
        if sample:
            torch.manual_seed(seed * 1_000_003 + start)
        finished = FinishedRows(ends, on_done)
        seqs = hf_model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                                 generation_config=config, stopping_criteria=StoppingCriteriaList([finished]))
        for i, row in zip(order[start: start + batch_size], seqs[:, longest:].tolist()):
            out[i] = _cut(row, set(ends))
        if on_done is not None:
            on_done(len(chunk) - finished.count)  # the rows cut at max_new_tokens
    return [g for g in out if g is not None]


def generate_responses_vllm(target_dir: str, prompts: Sequence[Sequence[int]], *, end_ids: Sequence[int],
                            max_new_tokens: int = 256, temperature: float = 0.0, seed: int = 0,
                            max_num_seqs: int | None = None, dtype: str | None = None,
                            enforce_eager: bool | None = None,
                            on_done: Callable[[int], None] | None = None) -> list[Generated]:
    """`generate_responses` served by vLLM (self-distillation with the engine users deploy). Greedy by
    default; at `temperature > 0` each request is seeded from `seed` and its index. The engine runs in
    this process with a bounded CPU KV cache (`use_in_process_vllm_env`) and is shut down before
    returning; None options keep `build_llm`'s device defaults (CPU: `CPU_MAX_NUM_SEQS`).
    `on_done(n)` is called as requests finish."""
    from verl_speco.cpu_port.env import use_in_process_vllm_env
    from verl_speco.device import accelerator_type
    from verl_speco.engines import vllm_engine

    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens={max_new_tokens}: expected >= 1")
    ends = {int(i) for i in end_ids}
    use_in_process_vllm_env()
    longest = max(len(p) for p in prompts) + max_new_tokens
    if max_num_seqs is None and accelerator_type() == "cpu":
        max_num_seqs = CPU_MAX_NUM_SEQS
    llm = vllm_engine.build_llm(target_dir, None, max_model_len=longest, max_num_seqs=max_num_seqs, seed=seed,
                                dtype=dtype, enforce_eager=enforce_eager)
    try:
        rows = vllm_engine.generate(llm, prompts, max_new_tokens, temperature, ignore_eos=False,
                                    seed=seed if temperature > 0 else None, on_done=on_done)
    finally:
        vllm_engine.shutdown(llm)
    return [_cut(row, ends) for row in rows]
