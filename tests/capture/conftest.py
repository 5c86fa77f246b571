"""Tiny random HF decoders + a WordLevel chat tokenizer, built locally (no downloads)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from tokenizers import Regex, Tokenizer, models, pre_tokenizers
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    Qwen3Config,
    Qwen3ForCausalLM,
)

SPECIALS = ["<pad>", "<unk>", "<|im_start|>", "<|im_end|>"]
WORDS = ["\n", "system", "user", "assistant"] + [f"w{i}" for i in range(90)]
# Qwen-style template: "<|im_start|>ROLE\nCONTENT<|im_end|>\n" per message.
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def make_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {tok: i for i, tok in enumerate(SPECIALS + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex("\n"), "isolated"), pre_tokenizers.Split(Regex(" +"), "removed")])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>",
                                   eos_token="<|im_end|>", additional_special_tokens=SPECIALS[2:])
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tid(tokenizer: PreTrainedTokenizerFast, token: str) -> int:
    return int(tokenizer.convert_tokens_to_ids(token))


def make_qwen3(num_layers: int = 8, seed: int = 0) -> Qwen3ForCausalLM:
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=len(SPECIALS) + len(WORDS), hidden_size=64, intermediate_size=128,
                      num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                      head_dim=16, max_position_embeddings=512, tie_word_embeddings=False,
                      pad_token_id=0, eos_token_id=3, bos_token_id=None)
    model = Qwen3ForCausalLM(cfg).eval()
    with torch.no_grad():   # non-trivial norm weights, so "post-norm" is distinguishable
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return model


def make_llama(num_layers: int = 5, seed: int = 1) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(SPECIALS) + len(WORDS), hidden_size=48, intermediate_size=96,
                      num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=4,
                      max_position_embeddings=512, pad_token_id=0, eos_token_id=3, bos_token_id=None)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.model.norm.weight.uniform_(0.5, 1.5)
    return model


@pytest.fixture(scope="session")
def tokenizer() -> PreTrainedTokenizerFast:
    return make_tokenizer()


def make_gpt2(num_layers: int = 4, seed: int = 2) -> GPT2LMHeadModel:
    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=len(SPECIALS) + len(WORDS), n_embd=32, n_layer=num_layers, n_head=4,
                     n_positions=64)
    return GPT2LMHeadModel(cfg).eval()


class Tiny:
    """Builders exposed to tests through the ``tiny`` fixture (no cross-test imports needed)."""

    qwen3 = staticmethod(make_qwen3)
    llama = staticmethod(make_llama)
    gpt2 = staticmethod(make_gpt2)
    tokenizer = staticmethod(make_tokenizer)
    tid = staticmethod(tid)


@pytest.fixture(autouse=True)
def _one_thread():
    """Tiny models run ~8x faster on one intra-op thread than on two busy cores; restored after."""
    before = torch.get_num_threads()
    torch._C.set_num_threads(1)
    yield
    torch._C.set_num_threads(before)


@pytest.fixture(scope="session")
def tiny() -> type[Tiny]:
    return Tiny


@pytest.fixture(scope="session")
def qwen3() -> Qwen3ForCausalLM:
    return make_qwen3()


@pytest.fixture(scope="session")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A saved HF target directory (model + tokenizer), as the collect CLI loads it."""
    out = tmp_path_factory.mktemp("target")
    make_qwen3().save_pretrained(out)
    make_tokenizer().save_pretrained(out)
    return out
