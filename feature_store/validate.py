"""Value checks shared by the writer (before buffering), the reader (``check_values=True``) and the
inspector: floating fields finite, mask fields 0/1 and not all 0, token ids in ``[0, vocab_size)``.

The finiteness test reads the exponent bits (all ones = NaN/inf) in cache-sized chunks with numpy,
far faster than ``torch.isfinite`` on bf16 CPU tensors."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from feature_store.errors import EmptyMaskError, NonFiniteError, SampleError, TokenIdError
from feature_store.schema import Schema

# float dtype -> (same-width unsigned int view, exponent mask)
_EXPONENT = {
    torch.bfloat16: (torch.int16, np.uint16, 0x7F80), torch.float16: (torch.int16, np.uint16, 0x7C00),
    torch.float32: (torch.int32, np.uint32, 0x7F800000),
    torch.float64: (torch.int64, np.uint64, 0x7FF0000000000000),
}
_CHUNK = 1 << 16
_ERRORS: dict[str, type[SampleError]] = {"non_finite": NonFiniteError, "empty_mask": EmptyMaskError,
                                         "bad_mask": EmptyMaskError, "token_id": TokenIdError}


@dataclass(frozen=True)
class Problem:
    kind: str       # non_finite | empty_mask | bad_mask | token_id
    field: str
    message: str


def all_finite(t: torch.Tensor) -> bool:
    """True when no element of the floating tensor ``t`` is NaN or +-inf."""
    int_dtype, np_dtype, mask = _EXPONENT[t.dtype]
    flat = t.contiguous().view(int_dtype).reshape(-1).numpy().view(np_dtype)
    tmp = np.empty(min(_CHUNK, flat.size), dtype=np_dtype)
    m: Any = np_dtype(mask)
    for i in range(0, flat.size, _CHUNK):
        part = flat[i: i + _CHUNK]
        out = tmp[: part.size]
        np.bitwise_and(part, m, out=out)
        if out.max() == m:
            return False
    return True


def _nonfinite(name: str, t: torch.Tensor) -> Problem | None:
    if t.numel() == 0 or all_finite(t):
        return None
    bad = ~torch.isfinite(t.float())
    rows = bad.reshape(t.shape[0], -1).any(dim=1).nonzero() if t.dim() > 0 else bad.reshape(1).nonzero()
    return Problem("non_finite", name, f"field {name!r}: {int(bad.sum())} non-finite value(s) (NaN/inf), first "
                                       f"at row {int(rows[0])}; expected all finite")


def _mask(name: str, t: torch.Tensor) -> Problem | None:
    a = t.reshape(-1).numpy()
    if a.size == 0 or not a.any():
        return Problem("empty_mask", name, f"field {name!r}: mask has no 1 among {a.size} value(s); expected at "
                                           "least one (a sample without supervised tokens)")
    if a.dtype != np.bool_ and (a.min() < 0 or a.max() > 1):
        return Problem("bad_mask", name, f"field {name!r}: mask values in [{a.min()}, {a.max()}], expected 0/1")
    return None


def _token_ids(name: str, t: torch.Tensor, vocab: int) -> Problem | None:
    if t.numel() == 0:
        return None
    lo, hi = int(t.min()), int(t.max())
    if lo < 0 or hi >= vocab:
        bad = ((t < 0) | (t >= vocab)).reshape(-1).nonzero()
        return Problem("token_id", name, f"field {name!r}: token id(s) in [{lo}, {hi}], expected [0, {vocab}) "
                                         f"(vocab_size={vocab}); first bad at flat index {int(bad[0])}")
    return None


def sample_problems(schema: Schema, sample: Mapping[str, torch.Tensor]) -> list[Problem]:
    """Every value problem of one sample (fields already shaped per the schema)."""
    found: list[Problem] = []
    for f in schema.fields:
        t = sample[f.name]
        p: Problem | None = None
        if t.dtype in _EXPONENT:
            p = _nonfinite(f.name, t)
        elif f.kind == "mask":
            p = _mask(f.name, t)
        elif f.kind == "token_ids" and schema.vocab_size:
            p = _token_ids(f.name, t, schema.vocab_size)
        if p is not None:
            found.append(p)
    return found


def raise_problems(problems: list[Problem], where: str) -> None:
    """Raise the error class of the first problem (message lists them all), prefixed with ``where``."""
    if problems:
        msg = "; ".join(p.message for p in problems)
        raise _ERRORS[problems[0].kind](f"{where}: {msg}")
