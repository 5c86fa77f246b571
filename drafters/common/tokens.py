"""Token-sequence helpers shared by the reference decoder, generation and evaluation."""

from __future__ import annotations

from collections.abc import Collection, Sequence


def cut_at_end(tokens: Sequence[int], end_ids: Collection[int]) -> tuple[list[int], bool]:
    """(tokens up to and including the first end token, whether one was found)."""
    for k, tok in enumerate(tokens):
        if tok in end_ids:
            return list(tokens[: k + 1]), True
    return list(tokens), False
