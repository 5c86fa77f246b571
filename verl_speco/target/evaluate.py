"""Greedy evaluation of a built target against the corpus references (quality and drift checks).

Metrics over held-out prompts (each a fraction in [0, 1]):
- `exact`: the generation equals the reference response of `variant`;
- `first_line`: its first line equals the reference's first line (style: base and shifted differ there);
- `answer`: the reference answer string appears in its last line (arithmetic correctness)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from verl_speco.target.corpus import Example, generate_examples


def score(examples: Sequence[Example], outputs: Sequence[str]) -> dict[str, Any]:
    """Score generated assistant texts against the examples' references (see module docstring)."""
    if len(examples) != len(outputs):
        raise ValueError(f"len(outputs)={len(outputs)} but expected one per example ({len(examples)})")
    exact = first = answer = 0
    by_task: dict[str, list[int]] = {}
    for ex, out in zip(examples, outputs):
        lines = out.splitlines() or [""]
        ok = ex.answer in lines[-1]
        exact += out == ex.response
        first += lines[0] == ex.response.splitlines()[0]
        answer += ok
        hits = by_task.setdefault(ex.task, [0, 0])
        hits[0] += ok
        hits[1] += 1
    n = max(1, len(examples))
    return {"n": len(examples), "exact": exact / n, "first_line": first / n, "answer": answer / n,
            "answer_by_task": {task: hits[0] / hits[1] for task, hits in sorted(by_task.items())}}


def greedy_generate(model_dir: str | Path, prompts: Sequence[str], max_new_tokens: int = 160,
                    batch_size: int = 32) -> list[str]:
    """Greedy transformers generation of the assistant turn for each user prompt (stops at <|im_end|>)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    texts: list[str] = []
    for start in range(0, len(prompts), batch_size):
        chats = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False, add_generation_prompt=True)
                 for p in prompts[start:start + batch_size]]
        enc = tok(chats, return_tensors="pt", padding=True)
        with torch.no_grad():
            out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                                 eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        texts += tok.batch_decode(out[:, enc["input_ids"].shape[1]:], skip_special_tokens=True)
    return texts


def evaluate_target(model_dir: str | Path, n: int = 100, variant: str = "base", split: str = "test",
                    seed: int = 0, max_new_tokens: int = 160) -> dict[str, Any]:
    """Greedy-generate `n` held-out prompts and score them against the `variant` references."""
    examples = generate_examples(n, seed=seed, variant=variant, split=split)
    outputs = greedy_generate(model_dir, [ex.prompt for ex in examples], max_new_tokens)
    result = score(examples, outputs)
    result["samples"] = [{"prompt": ex.prompt, "output": out} for ex, out in list(zip(examples, outputs))[:3]]
    return result
