"""Byte-level BPE tokenizer for the embedded target (Qwen2/3 style, small vocabulary).

The Qwen2 split regex (every digit its own piece, so arithmetic stays digit-aligned) and GPT-2
byte-level mapping: all 256 bytes are symbols, so `decode(encode(x)) == x` exactly. Merges are
learned by `BpeTrainer` on a fixed corpus sample (reproducibility checked in the tests). Special
tokens: `<|endoftext|>` (pad), `<|im_start|>`, `<|im_end|>` (eos), `<|mask|>` (the block drafters'
mask id, never produced). No BOS, like Qwen3."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from verl_speco.target.corpus import generate_examples

PAD_TOKEN = "<|endoftext|>"
IM_START = "<|im_start|>"
EOS_TOKEN = "<|im_end|>"
MASK_TOKEN = "<|mask|>"
SPECIAL_TOKENS = (PAD_TOKEN, IM_START, EOS_TOKEN, MASK_TOKEN)
TOKENIZER_VERSION = "1"  # bump when the recipe below changes (part of the target recipe hash)

# Qwen2's pre-tokenization pattern (individual digits, words with one leading non-letter, punctuation),
# except that a digit keeps one leading space (` ?\p{N}`): " 947" -> " 9", "4", "7", which makes the
# step-by-step traces ~20% shorter than a separate space token before every number.
_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+| ?\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Qwen-style chat template: `<|im_start|>{role}\n{content}<|im_end|>\n` per message.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def render_chat(messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
    """Pure-Python rendering of CHAT_TEMPLATE (the reference the tests compare transformers against)."""
    text = "".join(f"{IM_START}{m['role']}\n{m['content']}{EOS_TOKEN}\n" for m in messages)
    return text + (f"{IM_START}assistant\n" if add_generation_prompt else "")


def training_texts(n_per_variant: int = 3000, seed: int = 12345) -> list[str]:
    """The fixed sample the merges are learned on: chat-rendered base and shifted examples."""
    texts = []
    for variant in ("base", "shifted"):
        for ex in generate_examples(n_per_variant, seed=seed, variant=variant):
            texts.append(render_chat(ex.messages))
    return texts


def train_tokenizer(vocab_size: int = 512, texts: list[str] | None = None) -> Tokenizer:
    """Train the byte-level BPE; `vocab_size` counts the 256 byte symbols and the special tokens."""
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ValueError(f"vocab_size={vocab_size} must be >= {256 + len(SPECIAL_TOKENS)} (bytes + specials)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_SPLIT_PATTERN), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts if texts is not None else training_texts(), trainer=trainer)
    return tok


def special_ids(tok: Tokenizer) -> tuple[int, int]:
    """(eos id, pad id) of a tokenizer built by `train_tokenizer`."""
    eos_id, pad_id = tok.token_to_id(EOS_TOKEN), tok.token_to_id(PAD_TOKEN)
    if eos_id is None or pad_id is None:
        raise ValueError(f"tokenizer lacks {EOS_TOKEN!r} or {PAD_TOKEN!r}: expected one built by train_tokenizer")
    return eos_id, pad_id


def save_tokenizer(tok: Tokenizer, out_dir: str | Path, model_max_length: int = 1024) -> None:
    """Write tokenizer.json, tokenizer_config.json (with the chat template) and chat_template.jinja.

    The config is written by hand with keys that transformers 4.x and 5.x (and so vLLM and SGLang)
    both read: `tokenizer_class` PreTrainedTokenizerFast, eos/pad, no bos, the template inline."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "additional_special_tokens": [IM_START, MASK_TOKEN],
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "add_bos_token": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)
