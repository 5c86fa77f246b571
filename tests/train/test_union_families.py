"""ONE union-layout store, collected once (`verl-speco-collect --layout-of eagle1,eagle3,dflash,dspark,domino,peagle`),
trains EAGLE-1, EAGLE-3, DFlash, DSpark, Domino and P-EAGLE with `verl-speco-draft-train` (single process, presets
quickstart_<family> with tiny overrides), and each run's export is accepted by its family's
`load_export` (weights equal to the trainer's final checkpoint).

Target: a tiny random 8-layer HF Qwen3 with a WordLevel chat tokenizer, saved locally. The union
layout is EAGLE-3's default aux ids (2, 4, 5) and DFlash's default context layers (2, 3, 4, 5, 6;
the preset reads (2, 4, 6) of them) plus the post-norm last hidden state EAGLE-1 reads.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Regex, Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen3Config, Qwen3ForCausalLM

from drafters.common.target import TargetHead
from drafters.registry import available_families, export_family, get_family
from feature_store import Layout, load_store
from verl_speco.capture.collect import main as collect_main
from verl_speco.train.launcher import main as train_main

FAMILIES = ("eagle1", "eagle3", "dflash", "dspark", "domino", "peagle")
WORDS = ["<pad>", "<unk>", "<|im_start|>", "<|im_end|>", "\n", "system", "user", "assistant",
         *(f"w{i}" for i in range(56))]
TEMPLATE = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>' + '\n' }}"
            "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")


def _target(out: Path) -> Path:
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Split(Regex("\n"), "isolated"),
                                                 pre_tokenizers.Split(Regex(" +"), "removed")])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>",
                                   eos_token="<|im_end|>", additional_special_tokens=WORDS[2:4])
    fast.chat_template = TEMPLATE
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=len(WORDS), hidden_size=32, intermediate_size=64, num_hidden_layers=8,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=256,
                      tie_word_embeddings=False, pad_token_id=0, eos_token_id=3, bos_token_id=None)
    Qwen3ForCausalLM(cfg).eval().save_pretrained(out)
    fast.save_pretrained(out)
    return out


def _chats(path: Path, n: int = 12) -> Path:
    g = torch.Generator().manual_seed(5)
    words = lambda k: " ".join(f"w{int(i)}" for i in torch.randint(0, 56, (k,), generator=g))  # noqa: E731
    rows = [{"messages": [{"role": "user", "content": words(3 + i % 4)},
                          {"role": "assistant", "content": words(4 + i % 5)}]} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture(scope="module")
def union(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    missing = [f for f in FAMILIES if f not in available_families()]
    if missing:
        pytest.skip(f"families {missing} are not implemented")
    root = tmp_path_factory.mktemp("union_families")
    target = _target(root / "target")
    store = root / "store"
    rc = collect_main(["--target", str(target), "--data", str(_chats(root / "chats.jsonl")), "--store", str(store),
                       "--batch-size", "4", "--layout-of", ",".join(FAMILIES)])
    assert rc == 0
    return {"target": target, "store": store, "root": root}


def test_the_union_store_holds_every_layout(union: dict[str, Path]) -> None:
    assert load_store(union["store"]).schema.layout == Layout((2, 3, 4, 5, 6), last_hidden="post_norm")


PRESET_OVERRIDES = {"eagle1": (), "eagle3": ("drafter.settings.ttt_steps=2",),
                    "dflash": ("drafter.settings.mask_token_id=63",),  # this tokenizer has no mask token
                    "dspark": ("drafter.settings.mask_token_id=63", "drafter.settings.markov_rank=8"),
                    "domino": ("drafter.settings.mask_token_id=63", "drafter.settings.gru_hidden_dim=8",
                               "drafter.settings.emb_dim=8"),
                    "peagle": ("drafter.settings.mask_token_id=63", "drafter.settings.num_segments=2")}


@pytest.mark.parametrize("name", FAMILIES)
def test_one_union_store_trains_each_family_and_its_export_loads(union: dict[str, Path], name: str) -> None:
    out = union["root"] / f"run_{name}"
    rc = train_main(["--nproc-per-node", "1", f"preset=quickstart_{name}", f"target.path={union['target']}",
                     f"data.store={union['store']}", f"run.out_dir={out}", "data.micro_batch_size=2",
                     "data.eval_samples=0", "data.prefetch=0", "data.max_seq_len=64", "run.total_steps=3",
                     "run.save_every=3", "run.eval_every=0", "run.log_every=1", "run.progress_bar=false",
                     "run.tensorboard=false", *PRESET_OVERRIDES[name]])
    assert rc == 0
    ck = out / "ckpt" / "step_3"
    assert export_family(ck / "export") == name  # the preset's family trained, not the default drafter
    family = get_family(name)
    model = family.load_export(ck / "export", TargetHead.from_pretrained(union["target"]))
    trained = load_file(str(ck / "trainer" / "model.safetensors"))
    state = model.state_dict()
    shared = [k for k in trained if k in state]
    assert shared and "fc.weight" in shared
    for key in shared:  # the export holds the trainer's final weights
        assert torch.equal(state[key].float(), trained[key].float()), key
