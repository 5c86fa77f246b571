"""Tiny Qwen3 targets and EAGLE-3 drafts for the engine tests, built locally (no downloads).

- `build_target(dir)`: random 8-layer Qwen3 (hidden 64, vocab 96) + WordLevel tokenizer.
- `build_normed_target(dir)`: the same with non-unit norm weights (the non-degenerate target of
  the parity tests); `greedy_samples` / `train_draft`: a briefly trained draft of any family.
- `build_cycle_target(dir, perm)`: a "bigram" Qwen3 whose greedy continuation of token x is
  perm[x]: every layer adds nothing (o_proj = down_proj = 0), so each hidden state, including
  every aux capture, is the current token's embedding E[x]; lm_head row perm[x] is n(E[x]) (n =
  the final RMSNorm), which wins the argmax by a wide margin for random E in 64 dims.
- `oracle_draft(...)`: the EAGLE-3 draft that is exactly right at the FIRST draft step on the
  cycle target: fc copies the first aux slot (E[x_t]), the midlayer adds nothing, and lm_head
  row perm[perm[x]] is n(E[x]), so row t predicts x_{t+2} (what vLLM's first draft step asks for,
  see the engine notes). Later steps feed back the same hidden and repeat that token, so they are
  always wrong on a single-cycle permutation.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from drafters.common.target import TargetSpec
from drafters.eagle3.export import Eagle3ExportConfig, expected_shapes

VOCAB = 96
HIDDEN = 64
LAYERS = 8
AUX_IDS = (2, 4, 5)  # internal ids = (2, L//2, L-3), the EAGLE-3 default for L = 8
EOS_ID = 1

for _key, _val in {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "HF_HUB_OFFLINE": "1",
                   "VLLM_CPU_KVCACHE_SPACE": "1", "TOKENIZERS_PARALLELISM": "false"}.items():
    os.environ.setdefault(_key, _val)


def save_tokenizer(out_dir: Path, vocab_size: int = VOCAB) -> None:
    vocab = {"<pad>": 0, "<eos>": EOS_ID, **{f"t{i}": i for i in range(2, vocab_size)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<pad>",
                            eos_token="<eos>").save_pretrained(out_dir)


def _qwen3(seed: int) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=LAYERS,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                      tie_word_embeddings=False, pad_token_id=0, eos_token_id=EOS_ID, bos_token_id=None,
                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    return Qwen3ForCausalLM(cfg).eval().float()


def build_target(out_dir: Path, seed: int = 0) -> Path:
    model = _qwen3(seed)
    with torch.no_grad():  # sharper logits than the default init: fewer near-ties between engines
        model.lm_head.weight.normal_(0.0, 1.0)
    model.save_pretrained(out_dir)
    save_tokenizer(out_dir)
    return out_dir


def _unit_rms(x: torch.Tensor) -> torch.Tensor:
    return x / x.pow(2).mean(-1, keepdim=True).sqrt()


def build_cycle_target(out_dir: Path, perm: list[int], seed: int = 1) -> Path:
    model = _qwen3(seed)
    with torch.no_grad():
        emb = model.model.embed_tokens.weight
        emb.normal_(0.0, 1.0)  # no zero (padding) row: every token needs a direction
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.norm.weight.fill_(1.0)
        model.lm_head.weight[torch.tensor(perm)] = _unit_rms(emb)
    model.save_pretrained(out_dir)
    save_tokenizer(out_dir)
    return out_dir


def cycle_continuation(perm: list[int], start: int, n: int) -> list[int]:
    out, x = [], start
    for _ in range(n):
        x = perm[x]
        out.append(x)
    return out


def draft_config(draft_vocab_size: int = VOCAB) -> Eagle3ExportConfig:
    return Eagle3ExportConfig(hidden_size=HIDDEN, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                              intermediate_size=128, rms_norm_eps=1e-6, rope_theta=10000.0, vocab_size=VOCAB,
                              draft_vocab_size=draft_vocab_size, target_hidden_size=HIDDEN,
                              max_position_embeddings=512, aux_layer_ids=AUX_IDS, target_num_hidden_layers=LAYERS)


def random_draft(cfg: Eagle3ExportConfig, seed: int = 0, kept: list[int] | None = None) -> dict[str, torch.Tensor]:
    """Random weights of the right shapes; `kept` (sorted target ids) defines d2t/t2d."""
    gen = torch.Generator().manual_seed(seed)
    sd = {name: (torch.ones(shape) if name.endswith("norm.weight") else torch.randn(shape, generator=gen) * 0.2)
          for name, shape in expected_shapes(cfg).items() if name not in ("d2t", "t2d")}
    ids = torch.tensor(kept if kept is not None else range(cfg.draft_vocab_size), dtype=torch.int64)
    sd["d2t"] = ids - torch.arange(ids.numel())
    sd["t2d"] = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    sd["t2d"][ids] = True
    sd["embed_tokens.weight"] = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=gen)  # never exported
    return sd


def oracle_draft(cfg: Eagle3ExportConfig, target_dir: Path, perm: list[int]) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    emb = load_file(str(target_dir / "model.safetensors"))["model.embed_tokens.weight"]
    sd = random_draft(cfg, seed=5)
    sd["fc.weight"] = torch.cat([torch.eye(HIDDEN), torch.zeros(HIDDEN, 2 * HIDDEN)], dim=1)
    sd["midlayer.self_attn.o_proj.weight"].zero_()
    sd["midlayer.mlp.down_proj.weight"].zero_()
    two_step = torch.tensor([perm[perm[x]] for x in range(cfg.vocab_size)])
    sd["lm_head.weight"] = torch.zeros(cfg.vocab_size, HIDDEN)
    sd["lm_head.weight"][two_step] = _unit_rms(emb)
    return sd


def single_cycle(n: int, seed: int) -> list[int]:
    """A permutation of range(n) made of one n-cycle (so perm^k(x) != perm^j(x) for 0 < j < k < n)."""
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed)).tolist()
    perm = [0] * n
    for a, b in zip(order, order[1:] + order[:1]):
        perm[a] = b
    return perm


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_target(tmp_path_factory.mktemp("target"))


@pytest.fixture(scope="module")
def draft(target_dir: Path) -> tuple[torch.nn.Module, Eagle3ExportConfig]:
    """A random EAGLE-3 draft (draft vocab 48) for the tiny target, and its export config."""
    from drafters.common.contract import StoreStats
    from drafters.common.target import TargetHead
    from drafters.eagle3 import FAMILY, Eagle3Config

    head = TargetHead.from_pretrained(target_dir)
    counts = torch.randint(0, 1000, (VOCAB,), generator=torch.Generator().manual_seed(3))
    cfg = Eagle3Config(draft_vocab_size=48, aux_layer_ids=AUX_IDS, attn_backend="sdpa")
    torch.manual_seed(0)
    model = FAMILY.build(cfg, head, StoreStats(counts))
    return model, Eagle3ExportConfig.from_drafter(cfg, head.spec)


# ---------------------------------------------------------------------------------------------
# A non-degenerate target and drafts trained on it (tests/engines/test_family_vllm_parity.py,
# tests/engines/test_vllm_eagle1.py): every family goes through the family protocol only.


def build_normed_target(out_dir: Path, seed: int = 0) -> Path:
    """The random 8-layer Qwen3 of `_qwen3` (real attention and MLP) with every RMSNorm weight
    (input / post-attention / q / k / final) drawn from U[0.5, 1.5), so a pre-norm / post-norm
    mix-up or a swapped norm changes the drafts, and a sharp LM head (few near-ties)."""
    model = _qwen3(seed)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 1.0, generator=gen)  # sharp logits: few near-ties
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)  # U[0.5, 1.5)
    model.save_pretrained(out_dir)
    save_tokenizer(out_dir)
    return out_dir


def greedy_samples(family: Any, cfg: Any, target_dir: Path, num: int = 16, prompt_len: int = 6,
                   new_tokens: int = 34, seed: int = 7) -> list[dict[str, torch.Tensor]]:
    """Feature-store samples of the target's own greedy continuations of random prompts, with
    exactly the fields `family` requires at its layout (`aux_hidden` = HF hidden_states at the
    layout's layer ids, concatenated in order; `last_hidden` = the post-final-norm state)."""
    from transformers import Qwen3ForCausalLM

    hf = Qwen3ForCausalLM.from_pretrained(target_dir).eval()
    layout = family.required_layout(cfg, TargetSpec.from_pretrained(target_dir))
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(2, VOCAB, (num, prompt_len), generator=gen)
    with torch.no_grad():
        seqs = hf.generate(prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=new_tokens,
                           do_sample=False, min_new_tokens=new_tokens, pad_token_id=0)
        out = hf(input_ids=seqs, output_hidden_states=True)
    last = out.hidden_states[-1]  # must be post-final-norm (the EAGLE-1 feature, the store's last_hidden)
    torch.testing.assert_close(last @ hf.lm_head.weight.T, out.logits, rtol=1e-4, atol=1e-4)
    mask = torch.ones_like(seqs, dtype=torch.uint8)
    mask[:, :prompt_len] = 0
    samples = []
    for b in range(num):
        s = {"input_ids": seqs[b], "loss_mask": mask[b], "last_hidden": last[b]}
        if layout.layer_ids:
            s["aux_hidden"] = torch.cat([out.hidden_states[i][b] for i in layout.layer_ids], dim=-1)
        missing = [f for f in family.required_fields(cfg) if f not in s]
        assert not missing, f"{family.name} needs fields {missing}: teach greedy_samples to build them"
        samples.append({f: s[f] for f in family.required_fields(cfg)})
    return samples


def train_draft(family: Any, cfg: Any, target_dir: Path, steps: int = 120, lr: float = 5e-3,
                seed: int = 0, num_sequences: int = 16) -> torch.nn.Module:
    """A draft of `family` trained for a few seconds on the target's greedy continuations
    (`greedy_samples`), so its acceptance is well above chance: equal acceptance counters then
    mean equal drafts at many positions. Eval mode on return."""
    from drafters.common.contract import StoreStats
    from drafters.common.target import TargetHead
    from drafters.common.vocab import token_counts_from_samples

    samples = greedy_samples(family, cfg, target_dir, num=num_sequences)
    batch = family.collate(samples)
    torch.manual_seed(seed)
    model = family.build(cfg, TargetHead.from_pretrained(target_dir),
                         StoreStats(token_counts=token_counts_from_samples(samples, VOCAB)))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    for _ in range(steps):
        loss = family.objective(model.train(), batch).loss()
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


# -- vLLM engine runs shared by the parity tests (test_family_vllm_parity, test_vllm_eagle1) ------
K = 3  # num_speculative_tokens
MAX_TOKENS = 24
PROMPTS = [[5, 9, 13, 40, 2], [7, 7, 8], list(range(10, 30)), [90, 3, 3, 61], [44, 12]]


@contextmanager
def engine(target: Path, draft: Path | None = None, spec: dict[str, Any] | None = None) -> Iterator[Any]:
    """A vLLM engine on `target` with `spec` (a family's `vllm_speculative_config`) when given."""
    from verl_speco.engines import vllm_engine

    spec = spec or {}
    extra = {k: v for k, v in spec.items() if k not in ("method", "model", "num_speculative_tokens")}
    llm = vllm_engine.build_llm(target, draft, method=spec.get("method", "eagle3"),
                                num_speculative_tokens=spec.get("num_speculative_tokens", K),
                                speculative_extra=extra)
    try:
        yield llm
    finally:
        vllm_engine.shutdown(llm)


def greedy_run(llm: Any) -> tuple[list[list[int]], dict[str, Any]]:
    """PROMPTS decoded greedily for MAX_TOKENS tokens, with this call's acceptance figures."""
    from verl_speco.engines.vllm_engine import generate_with_metrics

    return generate_with_metrics(llm, PROMPTS, MAX_TOKENS)


def vllm_counts(m: dict[str, Any]) -> tuple[int, int, list[int]]:
    return m["num_drafts"], m["num_accepted_tokens"], list(m["accepted_per_pos"])

