"""Per-field write buffers of ``StoreWriter`` and its dtype policy.

``copy_inputs=True`` (default): each sample is copied (and cast) into a growable byte arena reused from
shard to shard, so the caller may reuse or modify its tensors as soon as ``add`` returns.
``copy_inputs=False``: the buffer keeps references to the caller's tensors (cast/made contiguous only
when needed, which copies) until the flush: no copy at all, but the caller must not modify them."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from feature_store.errors import SampleError
from feature_store.schema import FieldSpec

_MAX_HINT = 1 << 30        # reserved up front at most (virtual memory: untouched pages cost nothing)


def bytes_view(t: torch.Tensor) -> Any:
    return t.reshape(-1).view(torch.uint8).numpy()


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """``dst.copy_(src)``; a plain single-threaded memcpy (numpy, GIL released) when no cast is needed.

    torch's intra-op parallel copy is no faster for a memory-bound copy, and on an oversubscribed host
    (2 busy cores) its thread barrier made copies ~20x slower in the benchmark."""
    if (src.dtype == dst.dtype and src.device.type == "cpu" and src.is_contiguous() and dst.is_contiguous()
            and src.numel() == dst.numel()):
        np.copyto(bytes_view(dst), bytes_view(src))
        return dst
    return dst.copy_(src)


def clone(t: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of the CPU tensor ``t`` (see ``copy_into``)."""
    return copy_into(torch.empty(t.shape, dtype=t.dtype), t.contiguous())


def convert_check(spec: FieldSpec, t: torch.Tensor) -> None:
    """Raise ``SampleError`` unless ``t`` may be stored as ``spec.dtype`` without changing its meaning:
    float -> float (cast), int/bool -> int (range-checked), int -> bool (0/1 only); never float <-> int."""
    src, dst = t.dtype, spec.torch_dtype
    if src == dst or (src.is_floating_point and dst.is_floating_point):
        return
    if src.is_floating_point or dst.is_floating_point or src.is_complex:
        raise SampleError(f"field {spec.name!r}: dtype {str(src).removeprefix('torch.')}, expected "
                          f"{spec.dtype} (floating and integer data are never converted into each other)")
    if t.numel() == 0:
        return
    lo, hi = int(t.min()), int(t.max())
    limits = (0, 1) if dst == torch.bool else (torch.iinfo(dst).min, torch.iinfo(dst).max)
    if lo < limits[0] or hi > limits[1]:
        raise SampleError(f"field {spec.name!r}: values in [{lo}, {hi}] do not fit {spec.dtype} "
                          f"(range [{limits[0]}, {limits[1]}]); found dtype {str(src).removeprefix('torch.')}")


class FieldBuffer:
    """The buffered values of one field, in the schema's dtype, until the next flush."""

    def __init__(self, spec: FieldSpec, copy_inputs: bool) -> None:
        self.spec, self.copy_inputs = spec, copy_inputs
        self._arena = torch.empty(0, dtype=torch.uint8)
        self._refs: list[torch.Tensor] = []
        self.nbytes = 0

    def append(self, t: torch.Tensor, hint: int = 0) -> torch.Tensor:
        """Buffer ``t`` (already validated); returns the stored tensor (schema dtype, ``t``'s shape).
        ``hint``: the size the arena is expected to reach (allocated at once: growing copies nothing)."""
        dtype, size = self.spec.torch_dtype, t.numel() * self.spec.torch_dtype.itemsize
        if not self.copy_inputs:
            stored = t.to(device="cpu", dtype=dtype).contiguous()
            self._refs.append(stored)
            self.nbytes += size
            return stored
        need = self.nbytes + size
        if need > self._arena.numel():
            grown = torch.empty(max(need, 2 * self._arena.numel(), min(hint, _MAX_HINT), 1 << 16), dtype=torch.uint8)
            copy_into(grown[: self.nbytes], self._arena[: self.nbytes])
            self._arena = grown
        dst = self._arena[self.nbytes: need].view(dtype).view(t.shape)
        self.nbytes = need
        return copy_into(dst, t)

    def mark(self) -> tuple[int, int]:
        return self.nbytes, len(self._refs)

    def rollback(self, mark: tuple[int, int]) -> None:
        self.nbytes = mark[0]
        del self._refs[mark[1]:]

    def chunks(self) -> list[Any]:
        """The buffered bytes, in order, as byte buffers (views, no copy)."""
        if self.copy_inputs:
            return [self._arena[: self.nbytes].numpy()]
        return [bytes_view(t) for t in self._refs if t.numel()]

    def reset(self) -> None:
        self.nbytes = 0
        self._refs.clear()
