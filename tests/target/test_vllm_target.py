"""Real vLLM (CPU) serves the built target exactly like transformers does (greedy, token ids)."""

from pathlib import Path
from typing import Any

import pytest
import torch

PROMPTS = ["What is 347 + 589?", "Multiply 64 by 7.", "Sort these numbers in ascending order: 42, 7, 19."]
MAX_NEW = 24


def _hf_greedy(model, prompt_ids: list[int], n: int) -> list[int]:
    """Greedy decoding by hand: full forward each step, argmax, no KV cache and no EOS stop."""
    ids = list(prompt_ids)
    with torch.no_grad():
        for _ in range(n):
            logits = model(torch.tensor([ids])).logits  # [1, seq, vocab]
            ids.append(int(logits[0, -1].argmax()))
    return ids[len(prompt_ids):]


@pytest.mark.vllm
def test_vllm_greedy_matches_transformers(fast_target: Path, monkeypatch) -> None:
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import LLM

    tok = AutoTokenizer.from_pretrained(str(fast_target))
    hf = AutoModelForCausalLM.from_pretrained(str(fast_target)).eval()
    chats = [[{"role": "user", "content": p}] for p in PROMPTS]
    prompt_ids = [list(tok.apply_chat_template(c, add_generation_prompt=True, return_dict=False)) for c in chats]
    expected = [_hf_greedy(hf, ids, MAX_NEW) for ids in prompt_ids]
    assert all(len(set(e)) >= 3 for e in expected)  # not a degenerate constant stream

    from verl_speco.cpu_port import install_cpu_port

    install_cpu_port()  # bug C: this process may have built an n-gram engine (numba) before
    llm = LLM(model=str(fast_target), dtype="float32", max_model_len=512, enforce_eager=True, seed=0)
    try:
        _check_served(llm, tok, chats, prompt_ids, expected)
    finally:  # the in-process engine's process group must not outlive the test (tests/train starts its own)
        from vllm.distributed import cleanup_dist_env_and_memory

        del llm
        cleanup_dist_env_and_memory()


def _check_served(llm: Any, tok: Any, chats: list[Any], prompt_ids: list[list[int]], expected: list[list[int]]) -> None:
    """vLLM's greedy tokens equal transformers' (`expected`); its chat template and detokenizing match."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in prompt_ids], params)
    assert [list(o.outputs[0].token_ids) for o in outs] == expected
    # vLLM applies the saved chat template itself and detokenizes like transformers
    chat_outs = llm.chat(chats, SamplingParams(temperature=0.0, max_tokens=MAX_NEW))
    for out, ids in zip(chat_outs, prompt_ids):
        assert list(out.prompt_token_ids) == ids
        gen = list(out.outputs[0].token_ids)
        assert out.outputs[0].text == tok.decode(gen, skip_special_tokens=True)
