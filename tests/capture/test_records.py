"""Loss masks against hand-written masks; records, schema and the length policy."""

from __future__ import annotations

import json

import pytest
import torch

from feature_store import Layout
from verl_speco.capture.chat import (
    TokenizedChat,
    join_generated,
    load_chats,
    normalize_record,
    prompt_messages,
    tokenize_chat,
)
from verl_speco.capture.hooks import CapturedFeatures
from verl_speco.capture.records import LengthFilter, batch_records, build_schema, capture_layout, pad_batch

CHAT = [{"role": "system", "content": "w1 w2"}, {"role": "user", "content": "w3"},
        {"role": "assistant", "content": "w4 w5"}, {"role": "user", "content": "w6"},
        {"role": "assistant", "content": "w7"}]


def test_loss_mask_hand_written(tokenizer) -> None:
    chat = tokenize_chat(tokenizer, CHAT, [tokenizer.eos_token_id])
    tokens = tokenizer.convert_ids_to_tokens(chat.input_ids.tolist())
    S, E, N = "<|im_start|>", "<|im_end|>", "\n"
    expected = [
        (S, 0), ("system", 0), (N, 0), ("w1", 0), ("w2", 0), (E, 0), (N, 0),
        (S, 0), ("user", 0), (N, 0), ("w3", 0), (E, 0), (N, 0),
        (S, 0), ("assistant", 0), (N, 0), ("w4", 1), ("w5", 1), (E, 1), (N, 0),
        (S, 0), ("user", 0), (N, 0), ("w6", 0), (E, 0), (N, 0),
        (S, 0), ("assistant", 0), (N, 0), ("w7", 1), (E, 1), (N, 0),
    ]
    assert tokens == [t for t, _ in expected]
    assert chat.loss_mask.tolist() == [m for _, m in expected]
    assert chat.input_ids.dtype == torch.int64 and chat.loss_mask.dtype == torch.uint8
    assert chat.num_response_tokens == 5


def test_loss_mask_without_end_token_and_bad_templates(tokenizer) -> None:
    # no end-of-turn ids known: the turn ends where its own rendering ends (incl. the trailing "\n")
    chat = tokenize_chat(tokenizer, CHAT[:3], end_ids=[])
    assert chat.loss_mask.tolist() == [0] * 16 + [1, 1, 1, 1]
    with pytest.raises(ValueError, match="preceding message"):
        tokenize_chat(tokenizer, [{"role": "assistant", "content": "w1"}], [3])
    tok = tokenizer.__class__(tokenizer_object=tokenizer.backend_tokenizer, eos_token="<|im_end|>")
    # a template whose generation prompt is not a prefix of the full rendering
    tok.chat_template = ("{% for m in messages %}{{ m['role'] + ' ' + m['content'] + ' ' }}{% endfor %}"
                         "{% if add_generation_prompt %}{{ 'system ' }}{% endif %}")
    with pytest.raises(ValueError, match="not a token prefix"):
        tokenize_chat(tok, CHAT[1:3], [3])
    # assistant turns without an end token: a turn's mask stops where its rendering stops, it never
    # runs on to the next user turn's <|im_end|>
    tok.chat_template = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] }}"
                         "{% if m['role'] != 'assistant' %}{{ '<|im_end|>' }}{% endif %}{{ '\n' }}{% endfor %}"
                         "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
    chat = tokenize_chat(tok, CHAT[1:], [3])
    assert tok.convert_ids_to_tokens(chat.input_ids.tolist())[9:13] == ["w4", "w5", "\n", "<|im_start|>"]
    assert chat.loss_mask.tolist() == [0] * 9 + [1, 1, 1] + [0] * 9 + [1, 1]


def test_generated_mask_and_prompt_messages() -> None:
    chat = join_generated([5, 6, 7], [8, 9, 3])
    assert chat.input_ids.tolist() == [5, 6, 7, 8, 9, 3] and chat.loss_mask.tolist() == [0, 0, 0, 1, 1, 1]
    assert prompt_messages(CHAT) == CHAT[:4]
    assert prompt_messages(CHAT[:4]) == CHAT[:4]


def test_dataset_formats(tmp_path) -> None:
    rows = [{"messages": CHAT[1:3]},
            {"conversations": [{"from": "human", "value": "w3"}, {"from": "gpt", "value": "w4 w5"}]},
            {"prompt": "w3", "response": "w4 w5"}, {"prompt": [{"role": "user", "content": "w3"}]}]
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    chats = load_chats(path)
    assert chats[0] == chats[1] == chats[2] == CHAT[1:3] and chats[3] == CHAT[1:2]
    assert len(load_chats(path, max_samples=2)) == 2
    with pytest.raises(ValueError, match="d.jsonl:1"):
        path.write_text('{"text": "w1"}\n')
        load_chats(path)
    with pytest.raises(ValueError, match="message 0"):
        normalize_record({"messages": [{"role": "robot", "content": "x"}]}, "row")


def test_length_filter_counts() -> None:
    f = LengthFilter(min_response_tokens=2, max_length=5)
    a = TokenizedChat(torch.arange(4), torch.tensor([0, 0, 1, 1], dtype=torch.uint8))
    b = TokenizedChat(torch.arange(7), torch.tensor([0, 0, 0, 1, 1, 1, 1], dtype=torch.uint8))  # cut -> 2
    c = TokenizedChat(torch.arange(4), torch.tensor([0, 0, 0, 1], dtype=torch.uint8))           # short
    d = TokenizedChat(torch.arange(9), torch.tensor([0] * 5 + [1] * 4, dtype=torch.uint8))      # cut -> 0
    out = [f.apply(x, i) for i, x in enumerate([a, b, c, d])]
    assert out[0] is a and out[2] is None and out[3] is None
    assert out[1].input_ids.tolist() == [0, 1, 2, 3, 4] and out[1].loss_mask.tolist() == [0, 0, 0, 1, 1]
    assert f.summary() == {"kept": 2, "truncated": 2, "dropped_short": 2} and f.dropped_examples == [2, 3]
    with pytest.raises(ValueError, match="min_response_tokens"):
        LengthFilter(min_response_tokens=0)


def test_batch_records_and_schema() -> None:
    chats = [TokenizedChat(torch.tensor([5, 6, 7]), torch.tensor([0, 1, 1], dtype=torch.uint8)),
             TokenizedChat(torch.tensor([8, 9]), torch.tensor([0, 1], dtype=torch.uint8))]
    ids, mask = pad_batch(chats, pad_id=0)
    assert ids.tolist() == [[5, 6, 7], [8, 9, 0]] and mask.tolist() == [[1, 1, 1], [1, 1, 0]]
    h = {i: torch.randn(2, 3, 4) for i in (1, 3)}
    last = torch.randn(2, 3, 4)
    recs = batch_records(chats, CapturedFeatures((3, 1), h, last))
    assert torch.equal(recs[1]["aux_hidden"], torch.cat([h[3][1, :2], h[1][1, :2]], -1))   # layout order
    assert torch.equal(recs[1]["last_hidden"], last[1, :2]) and recs[0]["aux_hidden"].shape == (3, 8)
    schema = build_schema(capture_layout((3, 1)), hidden_size=4, vocab_size=98, target_model_id="tiny")
    assert schema.layout.layer_ids == (3, 1) and schema.layout.last_hidden == "post_norm"
    assert {f.name: (f.dtype, f.shape) for f in schema.fields} == {
        "input_ids": ("int64", ()), "loss_mask": ("uint8", ()), "aux_hidden": ("bfloat16", (8,)),
        "last_hidden": ("bfloat16", (4,))}
    no_last = build_schema(capture_layout((2,), last_hidden=False), 4, 98, "tiny", dtype=torch.float32)
    assert no_last.names == ("input_ids", "loss_mask", "aux_hidden") and no_last.layout.last_hidden == "none"
    with pytest.raises(ValueError, match="post_norm"):
        build_schema(Layout((2,), last_hidden="pre_norm"), 4, 98, "tiny")
