import re

import pytest

from verl_speco.target.corpus import generate_examples
from verl_speco.target.tokenizer import (
    CHAT_TEMPLATE,
    EOS_TOKEN,
    IM_START,
    MASK_TOKEN,
    PAD_TOKEN,
    render_chat,
    save_tokenizer,
    train_tokenizer,
)


@pytest.fixture(scope="module")
def tok():
    return train_tokenizer()


@pytest.fixture(scope="module")
def hf_dir(tok, tmp_path_factory):
    out = tmp_path_factory.mktemp("tok")
    save_tokenizer(tok, out)
    return out


def test_training_is_deterministic(tok) -> None:
    assert train_tokenizer().to_str() == tok.to_str()


def test_small_vocab_digits_single(tok) -> None:
    vocab = tok.get_vocab()
    assert 300 <= len(vocab) <= 1000
    multi_digit = [t for t in vocab if len(re.findall(r"[0-9]", t)) > 1]
    assert multi_digit == []  # digits never merge: arithmetic stays digit-aligned
    for special in (PAD_TOKEN, IM_START, EOS_TOKEN, MASK_TOKEN):
        assert tok.encode(special).ids == [tok.token_to_id(special)]


@pytest.mark.parametrize("variant", ["base", "shifted"])
def test_lossless_on_corpus(tok, variant) -> None:
    unk_free_vocab = tok.get_vocab_size()
    for ex in generate_examples(300, seed=99, variant=variant, split="test"):
        text = render_chat(ex.messages)
        enc = tok.encode(text)
        assert tok.decode(enc.ids, skip_special_tokens=False) == text
        assert max(enc.ids) < unk_free_vocab
    # template words of the traces are single tokens (the tokenizer learned the corpus)
    assert len(tok.encode(" carry").ids) == 1 and len(tok.encode(" write").ids) == 1


def test_lossless_on_arbitrary_text(tok) -> None:
    text = "Héllo  wörld\t\n\n 12,345.6 — 世界 🙂 <tag> 'quote's\r\n  "
    assert tok.decode(tok.encode(text).ids) == text


def test_hf_tokenizer_and_chat_template(tok, hf_dir) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(hf_dir))
    assert hf.eos_token == EOS_TOKEN and hf.eos_token_id == tok.token_to_id(EOS_TOKEN)
    assert hf.pad_token == PAD_TOKEN and hf.bos_token is None
    assert hf.chat_template == CHAT_TEMPLATE
    msgs = [{"role": "user", "content": "What is 12 + 3?"}, {"role": "assistant", "content": "It is 15."}]
    expected = "<|im_start|>user\nWhat is 12 + 3?<|im_end|>\n<|im_start|>assistant\nIt is 15.<|im_end|>\n"
    assert render_chat(msgs) == expected
    assert hf.apply_chat_template(msgs, tokenize=False) == expected
    prompt = hf.apply_chat_template(msgs[:1], tokenize=False, add_generation_prompt=True)
    assert prompt == "<|im_start|>user\nWhat is 12 + 3?<|im_end|>\n<|im_start|>assistant\n"
    ids = hf.apply_chat_template(msgs[:1], add_generation_prompt=True, return_dict=False)
    assert list(ids) == tok.encode(prompt).ids
    text = render_chat(generate_examples(1)[0].messages)
    assert hf(text)["input_ids"] == tok.encode(text).ids
    assert hf.decode(hf(text)["input_ids"]) == text


def test_vocab_size_floor() -> None:
    with pytest.raises(ValueError, match="vocab_size=100"):
        train_tokenizer(100)
