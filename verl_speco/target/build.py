"""Build and fine-tune the embedded default target into the target cache (`cache.py`).

`default_recipe` / `fast_recipe` name what is built, `ensure_target` builds it once (bit-identical
run to run on a given torch build and CPU: fixed `num_threads`), `finetune_target` derives a drifted
target from a built one. The CLI is `verl-speco-build-target` (`named.main`)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, replace
from pathlib import Path

from verl_speco.target.cache import (
    BUILD_VERSION,
    RECIPE_FILE,
    Log,
    TargetRecipe,
    build_atomically,
    cache_root,
    read_recipe_file,
    verify_digests,
)
from verl_speco.target.train import TrainSpec


def default_recipe(steps: int | None = None) -> TargetRecipe:
    """The default target (about 2 minutes on 2 idle cores); `steps` overrides the step count."""
    recipe = TargetRecipe()
    return recipe if steps is None else with_steps(recipe, steps)


def with_steps(recipe: TargetRecipe, steps: int) -> TargetRecipe:
    """`recipe` trained for `steps` steps (warmup clipped to fit); a different hash, so a new cache entry."""
    if steps < 1:
        raise ValueError(f"steps={steps} must be >= 1")
    train = replace(recipe.train, steps=steps, warmup_steps=min(recipe.train.warmup_steps, steps))
    return replace(recipe, train=train)


def fast_recipe(steps: int = 30) -> TargetRecipe:
    """Same architecture and tokenizer, few small steps: for tests (seconds, not minutes)."""
    base = TargetRecipe()
    return with_steps(replace(base, name="tiny-qwen3-fast", train=replace(base.train, warmup_steps=10)), steps)


def target_path(recipe: TargetRecipe | None = None, cache_dir: str | Path | None = None) -> Path:
    """Where `recipe` is (or would be) cached."""
    return cache_root(cache_dir) / "targets" / (recipe or default_recipe()).dirname


def ensure_target(
    recipe: TargetRecipe | None = None,
    *,
    cache_dir: str | Path | None = None,
    out: str | Path | None = None,
    force: bool = False,
    log: Log | None = None,
) -> Path:
    """Path of the built target for `recipe` (default: `default_recipe()`), building it if absent.

    `out` builds into that directory instead of the cache; `force` rebuilds even if present."""
    from verl_speco.target.produce import produce_target

    recipe = recipe or default_recipe()
    final = Path(out) if out is not None else target_path(recipe, cache_dir)
    return build_atomically(final, recipe.hash, force, lambda tmp: produce_target(tmp, recipe, log))


def finetune_target(
    base_dir: str | Path,
    out_dir: str | Path,
    corpus_variant: str = "shifted",
    steps: int = 100,
    seed: int = 1,
    lr: float = 1e-3,
    batch_size: int = 16,
    force: bool = False,
    log: Log | None = None,
) -> Path:
    """Fine-tune the target in `base_dir` on `corpus_variant` for `steps` steps; save to `out_dir`.

    Real, deterministic training (the drift a later RL step would cause). `out_dir` is reused when it
    already holds the same fine-tune of the same base; returns `out_dir`."""
    from verl_speco.target.produce import produce_finetune

    if steps < 1:
        raise ValueError(f"steps={steps} must be >= 1")
    base_recipe = read_recipe_file(base_dir)
    if base_recipe is None:
        raise FileNotFoundError(f"base_dir={str(base_dir)!r} holds no {RECIPE_FILE}: expected a built target")
    verify_digests(base_dir, base_recipe)
    spec = TrainSpec(steps=steps, batch_size=batch_size, lr=lr, warmup_steps=min(10, steps), seed=seed,
                     variant=corpus_variant, min_lr_ratio=0.1)
    key = {"base": base_recipe["hash"], "finetune": asdict(spec), "build": BUILD_VERSION}
    ft_hash = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    return build_atomically(Path(out_dir), ft_hash, force,
                            lambda tmp: produce_finetune(Path(base_dir), tmp, spec, key, ft_hash, log))

