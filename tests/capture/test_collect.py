"""collect_features / verl-speco-collect end to end, against references computed another way."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from verl_speco.capture.chat import encode_prompt, load_chats, tokenize_chat
from verl_speco.capture.collect import collect_features, forward_records, main
from verl_speco.capture.generate import generate_responses
from verl_speco.capture.records import resolve_layout


def _words(g: torch.Generator, n: int) -> str:
    return " ".join(f"w{int(i)}" for i in torch.randint(0, 90, (n,), generator=g))


def _chats(n: int = 7, seed: int = 0) -> list[list[dict[str, str]]]:
    g = torch.Generator().manual_seed(seed)
    chats = []
    for i in range(n):
        chat = [{"role": "user", "content": _words(g, 2 + 3 * i % 11)},
                {"role": "assistant", "content": _words(g, 1 + 5 * i % 9)}]
        if i % 3 == 1:
            chat = [{"role": "system", "content": _words(g, 3)}] + chat + [
                {"role": "user", "content": _words(g, 2)}, {"role": "assistant", "content": _words(g, 4)}]
        chats.append(chat)
    chats[3][-1]["content"] = ""        # response = just <|im_end|>: 1 response token
    return chats


@pytest.fixture()
def data(tmp_path: Path) -> Path:
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in _chats()))
    return path


def _read_store(root: Path, expect_layer_ids: tuple[int, ...] | None = None) -> list[dict[str, torch.Tensor]]:
    from feature_store import Layout, StoreReader

    layout = Layout(layer_ids=expect_layer_ids) if expect_layer_ids is not None else None
    with StoreReader(root, seed=0, shuffle=False, expect_layout=layout, prefetch=0, copy=True,
                     verify_checksums=True, check_values=True) as reader:
        it = reader.iter_samples()
        return [next(it) for _ in range(len(reader))]


def _by_ids(samples: list[dict[str, torch.Tensor]]) -> dict[tuple[int, ...], dict[str, torch.Tensor]]:
    return {tuple(s["input_ids"].tolist()): s for s in samples}


def test_batched_forward_equals_unbatched(qwen3, tokenizer) -> None:
    chats = [tokenize_chat(tokenizer, c, [3]) for c in _chats()]
    batched = forward_records(qwen3, chats, (0, 2, 4, 8), pad_id=0, dtype=torch.float32)
    for chat, rec in zip(chats, batched):
        alone = forward_records(qwen3, [chat], (0, 2, 4, 8), pad_id=0, dtype=torch.float32)[0]
        assert torch.equal(rec["input_ids"], alone["input_ids"]) and torch.equal(rec["loss_mask"], alone["loss_mask"])
        torch.testing.assert_close(rec["aux_hidden"], alone["aux_hidden"])     # float32 tolerance
        torch.testing.assert_close(rec["last_hidden"], alone["last_hidden"])
        assert rec["aux_hidden"].shape == (len(chat.input_ids), 4 * 64)


def _greedy_reference(model, prompt: list[int], max_new: int, eos: int) -> list[int]:
    """Full-sequence forward per step (no KV cache, no padding): the reference for generate."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(max_new):
            nxt = int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax())
            ids.append(nxt)
            if nxt == eos:
                break
    return ids[len(prompt):]


def test_generate_batched_equals_reference(tiny, tokenizer) -> None:
    model = tiny.qwen3()
    prompts = [encode_prompt(tokenizer, c[:1]) for c in _chats()]
    with torch.no_grad():       # make <|im_end|> beat the first greedy token of prompt 0: it stops at once
        first = int(model(input_ids=torch.tensor([prompts[0]])).logits[0, -1].argmax())
        model.lm_head.weight[3] = model.lm_head.weight[first] * 1.05
    batched = generate_responses(model, prompts, end_ids=[3], pad_id=0, max_new_tokens=8, batch_size=3)
    refs = [_greedy_reference(model, p, 8, eos=3) for p in prompts]
    assert [g.response_ids for g in batched] == refs
    assert [g.finished for g in batched] == [r[-1] == 3 for r in refs]
    assert any(g.finished for g in batched) and not all(g.finished for g in batched)
    sampled = [generate_responses(model, prompts, end_ids=[3], pad_id=0, max_new_tokens=8, temperature=1.0,
                                  seed=7) for _ in range(2)]
    assert sampled[0] == sampled[1]


def test_cli_end_to_end_reads_back(target_dir: Path, data: Path, tmp_path: Path, capsys) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    store = tmp_path / "store"
    rc = main(["--target", str(target_dir), "--data", str(data), "--store", str(store), "--layers", "0,2,4,8",
               "--batch-size", "3", "--min-response-tokens", "2", "--seed", "1"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "6 samples" in out and "dropped 1 short" in out
    meta = json.loads((store / "store.json").read_text())
    assert meta["schema"]["layout"]["layer_ids"] == [0, 2, 4, 8] and meta["schema"]["hidden_size"] == 64
    assert meta["producer"]["tool"] == "verl-speco-collect" and meta["schema"]["target_model_id"] == target_dir.name

    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(target_dir)
    stored = _by_ids(_read_store(store, (0, 2, 4, 8)))
    assert len(stored) == 6
    for chat in load_chats(data):
        ref = tokenize_chat(tok, chat, [3])
        if ref.num_response_tokens < 2:
            assert tuple(ref.input_ids.tolist()) not in stored
            continue
        sample = stored[tuple(ref.input_ids.tolist())]
        assert torch.equal(sample["loss_mask"], ref.loss_mask)
        with torch.no_grad():    # unbatched, via output_hidden_states (not hooks)
            hs = model(input_ids=ref.input_ids[None], output_hidden_states=True).hidden_states
        aux_ref = torch.cat([hs[i][0] for i in (0, 2, 4, 8)], -1)
        assert sample["aux_hidden"].dtype == torch.bfloat16
        torch.testing.assert_close(sample["aux_hidden"].float(), aux_ref, rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(sample["last_hidden"].float(), hs[8][0], rtol=1e-2, atol=1e-2)


def test_generate_eagle3_and_rank_sharding(target_dir: Path, data: Path, tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    store = tmp_path / "store"
    summaries = [collect_features(target_dir, data, store, families="eagle3", generate=True, max_new_tokens=5,
                                  batch_size=2, max_samples=5, dtype="float32", rank=r, world_size=2)
                 for r in (0, 1)]
    assert [s.samples for s in summaries] == [3, 2] and summaries[0].layer_ids == (2, 4, 5)
    assert sum(s.unfinished for s in summaries) <= 5
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(target_dir)
    stored = _read_store(store, (2, 4, 5))
    assert len(stored) == 5
    got = {tuple(s["input_ids"].tolist()): s["loss_mask"].tolist() for s in stored}
    for chat in load_chats(data, max_samples=5):
        context = chat[:-1]               # the dataset's last assistant turn is replaced by the target's
        prompt = encode_prompt(tok, context)
        response = _greedy_reference(model, prompt, 5, eos=3)
        assert got[tuple(prompt + response)] == [0] * len(prompt) + [1] * len(response)


def test_help_and_bad_arguments(tmp_path: Path, data: Path, target_dir: Path) -> None:
    res = subprocess.run([sys.executable, "-m", "verl_speco.capture.collect", "--help"], capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0 and "--generate" in res.stdout and "--layers" in res.stdout
    args = ["--target", str(target_dir), "--data", str(data), "--store", str(tmp_path / "s")]
    assert main(args + ["--layers", "2,x"]) == 2
    assert main(args + ["--layers", "2,9"]) == 2           # outside [0, 8]
    assert main(args[:3] + [str(tmp_path / "missing.jsonl")] + args[4:] + ["--layers", "2"]) == 2
    with pytest.raises(SystemExit):
        main(args + ["--layers", "2", "--family", "eagle3"])


def test_resolve_layout(qwen3) -> None:
    from drafters.common.target import TargetSpec
    from drafters.registry import get_family

    hf = qwen3.config.to_dict()
    layout, required = resolve_layout(None, "eagle3", hf)
    family = get_family("eagle3")
    assert layout == family.required_layout(family.config_cls(), TargetSpec.from_hf_config(hf))
    assert layout.layer_ids == (2, 4, 5) and layout.last_hidden == "post_norm"
    assert set(required) <= {"input_ids", "loss_mask", "aux_hidden", "last_hidden"}
    explicit, _ = resolve_layout((0, 8), None, hf, last_hidden=False)
    assert explicit.layer_ids == (0, 8) and explicit.last_hidden == "none"
    with pytest.raises(ValueError, match="no-such-family"):
        resolve_layout(None, "no-such-family", hf)
    with pytest.raises(ValueError, match=r"\[0, 8\]"):
        resolve_layout((1, 9), None, hf)
    with pytest.raises(ValueError, match="--layers"):
        resolve_layout(None, None, hf)
