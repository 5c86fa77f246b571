"""Storage encodings of floating per-token fields (``FieldSpec.encoding``); the one place fp8 numerics live.

``fp8_e4m3``: each token row ``x`` is stored as ``q = e4m3(x / s)`` with one float32 scale
``s = max|x| / 448`` per row (448: e4m3fn's largest finite value); decoding is ``q * s`` in float32,
cast to the field's dtype. Error bound per element (``fp8_error_bound``), from e4m3's 3 mantissa bits
and its subnormal step: ``|x - decode(encode(x))| <= 2**-4 * |x| + 2**-10 * s``. A row of zeros gets
the smallest positive normal float32 as its scale, so every stored scale is finite and > 0, which the
reader checks (``scale_problem``)."""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0                                   # torch.finfo(torch.float8_e4m3fn).max
_TINY = torch.finfo(torch.float32).tiny           # the scale of an all-zero row


def encode_fp8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [T, *shape]`` (finite floats) -> (e4m3 values ``[T, *shape]``, float32 scales ``[T]``)."""
    rows = x.reshape(x.shape[0], -1).to(torch.float32)                        # [T, D]
    scale = (rows.abs().amax(dim=1) / FP8_MAX).clamp_min(_TINY)               # [T]
    q = (rows / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)        # [T, D]
    return q.reshape(x.shape), scale


def decode_fp8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(e4m3 ``[T, *shape]``, float32 scales ``[T]``) -> ``[T, *shape]`` in ``dtype`` (a new tensor)."""
    rows = q.reshape(q.shape[0], -1).to(torch.float32) * scale[:, None]      # [T, D]
    return rows.to(dtype).reshape(q.shape)


def fp8_error_bound(x: torch.Tensor) -> torch.Tensor:
    """The largest ``|x - decode_fp8(*encode_fp8(x), float32)|`` the encoding allows, per element of ``x``."""
    rows = x.reshape(x.shape[0], -1).to(torch.float32)
    scale = (rows.abs().amax(dim=1) / FP8_MAX).clamp_min(_TINY)
    return (2.0 ** -4 * rows.abs() + 2.0 ** -10 * scale[:, None]).reshape(x.shape)


def scale_problem(scale: torch.Tensor) -> str | None:
    """Why stored scales ``[T]`` cannot be decoded (a NaN, inf, zero or negative entry), or None."""
    bad = ~(torch.isfinite(scale) & (scale > 0))
    if not bool(bad.any()):
        return None
    first = int(bad.nonzero()[0])
    return (f"{int(bad.sum())} fp8 scale(s) not finite and > 0, first at row {first} "
            f"(value {float(scale[first])!r}); expected every scale finite and positive")
