import hashlib
import json
import os
import stat
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from verl_speco.target.build import default_recipe, ensure_target, fast_recipe, finetune_target, target_path
from verl_speco.target.cache import (
    BuildDigestError,
    TargetRecipe,
    build_atomically,
    cache_root,
    file_digests,
    read_recipe_file,
)
from verl_speco.target.corpus import generate_examples
from verl_speco.target.named import main
from verl_speco.target.tokenizer import EOS_TOKEN, render_chat
from verl_speco.target.train import collate, encode_example


def test_recipe_hash_and_cache_location(monkeypatch, tmp_path) -> None:
    assert default_recipe().hash == TargetRecipe().hash  # stable for equal recipes
    assert default_recipe(steps=7).hash != default_recipe().hash
    assert fast_recipe().dirname.startswith("tiny-qwen3-fast-")
    monkeypatch.setenv("VERL_SPECO_CACHE", str(tmp_path / "c"))
    assert target_path() == tmp_path / "c" / "targets" / default_recipe().dirname
    assert cache_root(tmp_path / "x") == tmp_path / "x"
    monkeypatch.delenv("VERL_SPECO_CACHE")
    assert cache_root() == Path.home() / ".cache" / "verl_speco"


def test_loss_mask_covers_assistant_turn_and_eos() -> None:
    from tokenizers import Tokenizer

    from verl_speco.target.tokenizer import train_tokenizer

    tok: Tokenizer = train_tokenizer()
    ex = generate_examples(1)[0]
    ids, mask = encode_example(tok, ex)
    masked_text = tok.decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=False)
    assert masked_text == ex.response + EOS_TOKEN  # exactly the assistant turn and its <|im_end|>
    assert tok.decode(ids, skip_special_tokens=False) == render_chat(ex.messages)
    batch = collate([(ids, mask), (ids[:5], mask[:5])], pad_id=0)
    assert batch["input_ids"].shape == (2, len(ids))
    assert batch["attention_mask"][1].tolist() == [1] * 5 + [0] * (len(ids) - 5)
    assert (batch["labels"][1] == -100).all()  # the prompt-only row has no trained token


def test_fast_target_loads_and_generates(fast_target: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    info = read_recipe_file(fast_target)
    assert info["hash"] == fast_recipe().hash and info["kind"] == "target"
    assert info["final_loss"] < info["loss_curve"]["0"] - 1.0  # it trained
    umask = os.umask(0)
    os.umask(umask)
    assert stat.S_IMODE(fast_target.stat().st_mode) == 0o777 & ~umask  # not mkdtemp's 0700
    assert stat.S_IMODE((fast_target / "model.safetensors").stat().st_mode) == 0o666 & ~umask
    names = {p.name for p in fast_target.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json", "recipe.json"} <= names
    cfg = json.loads((fast_target / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3ForCausalLM"] and cfg["num_hidden_layers"] == 8
    assert cfg["tie_word_embeddings"] is False and cfg["rope_theta"] == 1_000_000.0
    tok = AutoTokenizer.from_pretrained(str(fast_target))
    model = AutoModelForCausalLM.from_pretrained(str(fast_target)).eval()
    assert model.config.vocab_size == len(tok) and model.dtype == torch.float32
    ids = tok.apply_chat_template([{"role": "user", "content": "What is 12 + 34?"}], add_generation_prompt=True,
                                  return_tensors="pt", return_dict=True)
    with torch.no_grad():
        out = model(**ids, output_hidden_states=True)
        gen = model.generate(**ids, max_new_tokens=12, do_sample=False)
    assert len(out.hidden_states) == 9  # embeddings + 8 layers: EAGLE-3 aux ids (2, 4, 5) all exist
    new = gen[0, ids["input_ids"].shape[1]:]
    assert 0 < len(new) <= 12
    # greedy = argmax of the first step's logits
    assert new[0].item() == out.logits[0, -1].argmax().item()


def test_cached_build_is_reused(fast_target: Path) -> None:
    before = (fast_target / "model.safetensors").stat().st_mtime_ns
    again = ensure_target(fast_recipe(), cache_dir=fast_target.parents[1])
    assert again == fast_target
    assert (fast_target / "model.safetensors").stat().st_mtime_ns == before


def test_build_is_deterministic(tmp_path) -> None:
    recipe = replace(fast_recipe(steps=3), name="det")
    a = ensure_target(recipe, out=tmp_path / "a")
    b = ensure_target(recipe, out=tmp_path / "b")
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()


def test_atomic_build_failures(tmp_path) -> None:
    final = tmp_path / "t"

    def boom(tmp: Path) -> None:
        (tmp / "partial").write_text("x")
        raise RuntimeError("interrupted")

    with pytest.raises(RuntimeError, match="interrupted"):
        build_atomically(final, "h1", False, boom)
    assert not final.exists()
    assert [p.name for p in tmp_path.iterdir() if not p.name.endswith(".lock")] == []
    final.mkdir()
    (final / "mine.txt").write_text("user data")
    with pytest.raises(FileExistsError, match="recipe hash h1"):
        build_atomically(final, "h1", False, lambda tmp: None)
    assert (final / "mine.txt").exists()


def test_cli_print_path(tmp_path, capsys) -> None:
    out = tmp_path / "cli"
    assert main(["--fast", "--steps", "2", "--out", str(out), "--print-path", "--quiet"]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    assert read_recipe_file(out)["recipe"]["train"]["steps"] == 2
    with pytest.raises(SystemExit):
        main(["--steps", "0"])


def _shifted_loss(model_dir: Path) -> float:
    from tokenizers import Tokenizer
    from transformers import AutoModelForCausalLM

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    rows = [encode_example(tok, ex) for ex in generate_examples(16, seed=0, variant="shifted", split="test")]
    with torch.no_grad():
        return model(**collate(rows, pad_id=0)).loss.item()


def test_finetune_drifts_toward_shifted(fast_target: Path, tmp_path) -> None:
    out = finetune_target(fast_target, tmp_path / "ft", corpus_variant="shifted", steps=8, seed=1, batch_size=16)
    info = read_recipe_file(out)
    assert info["kind"] == "finetune" and info["recipe"]["finetune"]["variant"] == "shifted"
    assert (out / "tokenizer.json").read_bytes() == (fast_target / "tokenizer.json").read_bytes()
    assert _shifted_loss(out) < _shifted_loss(fast_target) - 0.1
    mtime = (out / "model.safetensors").stat().st_mtime_ns
    assert finetune_target(fast_target, out, steps=8, seed=1, batch_size=16) == out  # same fine-tune: reused
    assert (out / "model.safetensors").stat().st_mtime_ns == mtime
    with pytest.raises(FileNotFoundError, match="base_dir"):
        finetune_target(tmp_path, tmp_path / "ft2", steps=1)


def test_build_records_and_checks_digests(tmp_path) -> None:
    recipe = replace(fast_recipe(steps=2), name="digest")
    out = ensure_target(recipe, out=tmp_path / "t")
    info = read_recipe_file(out)
    assert info["sha256"] == file_digests(out)  # every file but recipe.json, hashed at build time
    assert set(info["sha256"]) == {p.name for p in out.iterdir()} - {"recipe.json"}
    weights = info["sha256"]["model.safetensors"]
    assert weights == hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest()
    assert ensure_target(recipe, out=out) == out  # cache hit: digests verified
    data = bytearray((out / "model.safetensors").read_bytes())
    data[-1] ^= 1  # one flipped bit in the last weight
    (out / "model.safetensors").write_bytes(data)
    with pytest.raises(BuildDigestError, match=f"model.safetensors: sha256 [0-9a-f]{{64}}, recorded {weights}"):
        ensure_target(recipe, out=out)
    with pytest.raises(BuildDigestError, match="model.safetensors"):  # a fine-tune checks its base first
        finetune_target(out, tmp_path / "ft", steps=1)
    assert not (tmp_path / "ft").exists()
    ensure_target(recipe, out=out, force=True)  # the documented fix: rebuild, same bytes again
    assert hashlib.sha256((out / "model.safetensors").read_bytes()).hexdigest() == weights
    (out / "tokenizer.json").unlink()
    with pytest.raises(BuildDigestError, match="tokenizer.json: sha256 missing"):
        ensure_target(recipe, out=out)
    info.pop("sha256")
    (out / "recipe.json").write_text(json.dumps(info))
    with pytest.raises(BuildDigestError, match="records no sha256"):
        ensure_target(recipe, out=out)


def test_build_ignores_load_and_caller_threads(monkeypatch, tmp_path) -> None:
    """The default recipe, cut to 6 steps, built as on an idle and on a busy 2-core machine.

    The old build picked 2 intra-op threads on an idle machine and 1 on a busy one (load average
    minus its own threads), so the weights depended on what else ran (issue 9: 0.2522 vs 0.2536
    final loss). Training now always runs with the recipe's `num_threads`. A 6-step cut exercises
    the full recipe's code path: same model, batch size 16, data stream and optimizer, so every
    kernel runs on the full recipe's shapes; a thread count only changes results through kernels
    that split work by it, so what decides is the count each step runs with, observed here on
    every forward of the training (backward and optimizer step run on the same thread and setting).
    The third build runs after an in-process vLLM engine has replaced `torch.set_num_threads` by a
    no-op (the full suite failed this way: the build kept vLLM's 2 threads).
    """
    from verl_speco.target import produce

    real_train = produce.train
    seen: list[set[int]] = []

    def spy(model: torch.nn.Module, *args, **kwargs):
        threads: set[int] = set()
        hook = model.register_forward_pre_hook(lambda module, inputs: threads.add(torch.get_num_threads()))
        try:
            return real_train(model, *args, **kwargs)
        finally:
            hook.remove()
            seen.append(threads)

    monkeypatch.setattr(produce, "train", spy)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    recipe = default_recipe(steps=6)
    assert recipe.train.batch_size == default_recipe().train.batch_size and recipe.model == default_recipe().model
    before = torch.get_num_threads()
    digests = []
    scenarios = (("idle", 2, 0.0, False), ("busy", 1, 8.0, False), ("after-vllm", 2, 0.0, True))
    try:
        for name, caller_threads, load, vllm_patched in scenarios:
            torch._C.set_num_threads(caller_threads)
            monkeypatch.setattr(os, "getloadavg", lambda load=load: (load, load, load))
            if vllm_patched:  # what an in-process vLLM CPU worker does to the public setter
                monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
            out = ensure_target(recipe, out=tmp_path / name)
            assert torch.get_num_threads() == caller_threads, name  # restored
            digests.append(read_recipe_file(out)["sha256"]["model.safetensors"])
    finally:
        torch._C.set_num_threads(before)
    assert seen == [{recipe.train.num_threads}] * 3 and recipe.train.num_threads == 1
    assert len(set(digests)) == 1
    assert replace(recipe, train=replace(recipe.train, num_threads=2)).hash != recipe.hash  # another cache entry
    with pytest.raises(ValueError, match="num_threads=0"):
        replace(recipe.train, num_threads=0)
