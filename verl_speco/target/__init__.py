"""Embedded default target: a tiny Qwen3 causal LM with its own tokenizer, corpus and cache.

    from verl_speco.target import ensure_target, write_prompt_dataset
    model_dir = ensure_target()           # built once, then cached
    write_prompt_dataset("prompts.jsonl", n=64, variant="base", split="test", seed=0)"""

from verl_speco.target.build import default_recipe, ensure_target, fast_recipe, finetune_target, target_path
from verl_speco.target.cache import TargetRecipe, cache_root, read_recipe_file
from verl_speco.target.corpus import Example, generate_examples, iter_examples
from verl_speco.target.datasets import read_jsonl, write_prompt_dataset
from verl_speco.target.model import TargetModelSpec
from verl_speco.target.tokenizer import CHAT_TEMPLATE, EOS_TOKEN, MASK_TOKEN, PAD_TOKEN, render_chat
from verl_speco.target.train import TrainSpec

__all__ = [
    "CHAT_TEMPLATE", "EOS_TOKEN", "MASK_TOKEN", "PAD_TOKEN", "Example", "TargetModelSpec", "TargetRecipe",
    "TrainSpec", "cache_root", "default_recipe", "ensure_target", "fast_recipe", "finetune_target",
    "generate_examples", "iter_examples", "read_jsonl", "read_recipe_file", "render_chat", "target_path",
    "write_prompt_dataset",
]
