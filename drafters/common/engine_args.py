"""The engine arguments every family's export config builds the same way: `vllm_speculative_config`
(method from the catalog), `sglang_chain_args` (a chain of K steps) and `check_format`."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def vllm_speculative_config(family: str, draft_dir: str | Path, num_speculative_tokens: int) -> dict[str, Any]:
    from drafters.registry import engine_method

    method = engine_method(family, "vllm")
    return {"method": method.method, "model": str(draft_dir), "num_speculative_tokens": int(num_speculative_tokens),
            **dict(method.extra)}


def sglang_algorithm_args(family: str, draft_dir: str | Path) -> dict[str, Any]:
    """`--speculative-algorithm` (from the catalog) and `--speculative-draft-model-path`."""
    from drafters.registry import engine_method

    return {"speculative_algorithm": engine_method(family, "sglang").method,
            "speculative_draft_model_path": str(draft_dir)}


def sglang_chain_args(family: str, draft_dir: str | Path, num_speculative_tokens: int) -> dict[str, Any]:
    """A chain of `num_speculative_tokens` steps: topk 1, num_draft_tokens = steps + 1."""
    k = int(num_speculative_tokens)
    return {**sglang_algorithm_args(family, draft_dir), "speculative_num_steps": k, "speculative_eagle_topk": 1,
            "speculative_num_draft_tokens": k + 1}


def check_format(fmt: str, formats: tuple[str, ...]) -> None:
    if fmt not in formats:
        raise ValueError(f"fmt: got {fmt!r}, expected one of {formats}")
