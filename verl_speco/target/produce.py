"""Write a built (or fine-tuned) target into a fresh directory; `cache.py` makes it atomic and cached."""

from __future__ import annotations

import json
import platform
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from tokenizers import Tokenizer

from verl_speco.target.cache import DIGESTS_KEY, RECIPE_FILE, file_digests
from verl_speco.target.model import init_model, make_config
from verl_speco.target.tokenizer import save_tokenizer, special_ids, train_tokenizer
from verl_speco.target.train import TrainResult, TrainSpec, train

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from verl_speco.target.cache import Log, TargetRecipe

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def _versions() -> dict[str, str]:
    import tokenizers
    import transformers

    return {"torch": torch.__version__, "transformers": transformers.__version__,
            "tokenizers": tokenizers.__version__, "python": platform.python_version()}


def save_model(model: PreTrainedModel, out_dir: Path, eos_id: int, pad_id: int) -> None:
    """save_pretrained (safetensors, float32) + a greedy-neutral generation_config.json.

    config.json also gets a top-level `rope_theta` (transformers 5 keeps it only inside
    `rope_parameters`), so readers that parse config.json without transformers, and transformers 4.x,
    find it."""
    from transformers import GenerationConfig

    model.generation_config = GenerationConfig(eos_token_id=eos_id, pad_token_id=pad_id, bos_token_id=None)
    model.save_pretrained(str(out_dir), safe_serialization=True)
    cfg_path = out_dir / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["rope_theta"] = cfg["rope_parameters"]["rope_theta"]
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def _write_recipe(out_dir: Path, info: dict[str, Any], result: TrainResult) -> None:
    """Write RECIPE_FILE last, with the sha256 of every file written before it."""
    stride = max(1, len(result.losses) // 100)
    info = {**info, "final_loss": result.final_loss, "train_wall_s": round(result.wall_s, 2),
            "loss_curve": {str(i): round(v, 4) for i, v in enumerate(result.losses) if i % stride == 0},
            "versions": _versions(), DIGESTS_KEY: file_digests(out_dir)}
    (out_dir / RECIPE_FILE).write_text(json.dumps(info, indent=2, sort_keys=True) + "\n")


def produce_target(out_dir: Path, recipe: TargetRecipe, log: Log | None = None) -> None:
    """Train tokenizer and model from scratch for `recipe` and save everything into `out_dir`."""
    tok = train_tokenizer(recipe.vocab_size)
    eos_id, pad_id = special_ids(tok)
    config = make_config(recipe.model, tok.get_vocab_size(), eos_id, pad_id)
    model = init_model(config, recipe.train.seed)
    if log is not None:
        n_params = sum(p.numel() for p in model.parameters())
        log(f"building {recipe.dirname}: {n_params / 1e6:.2f}M params, vocab {tok.get_vocab_size()}, "
            f"{recipe.train.steps} steps x {recipe.train.batch_size} examples")
    result = train(model, tok, recipe.train, pad_id, log)
    save_model(model, out_dir, eos_id, pad_id)
    save_tokenizer(tok, out_dir, model_max_length=recipe.model.max_position_embeddings)
    _write_recipe(out_dir, {"kind": "target", "name": recipe.name, "hash": recipe.hash,
                            "recipe": recipe.to_dict()}, result)


def produce_finetune(
    base_dir: Path, out_dir: Path, spec: TrainSpec, key: dict[str, Any], ft_hash: str, log: Log | None = None
) -> None:
    """Continue training the target in `base_dir` with `spec` (e.g. the shifted corpus); save to `out_dir`."""
    from transformers import AutoModelForCausalLM

    tok = Tokenizer.from_file(str(base_dir / "tokenizer.json"))
    eos_id, pad_id = special_ids(tok)
    model = AutoModelForCausalLM.from_pretrained(str(base_dir), dtype=torch.float32, attn_implementation="sdpa")
    if log is not None:
        log(f"fine-tuning {base_dir} on the {spec.variant} corpus: {spec.steps} steps x {spec.batch_size}")
    result = train(model, tok, spec, pad_id, log)
    save_model(model, out_dir, eos_id, pad_id)
    for name in TOKENIZER_FILES:
        shutil.copy2(base_dir / name, out_dir / name)
    base_info = json.loads((base_dir / RECIPE_FILE).read_text())
    _write_recipe(out_dir, {"kind": "finetune", "name": f"{base_info['name']}-ft-{spec.variant}", "hash": ft_hash,
                            "recipe": key, "base_dir": str(base_dir)}, result)
