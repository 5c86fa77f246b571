"""SGLang bindings: the only module of ours importing sglang (lazily, inside functions; SGLang is CUDA-only).

Each function returns None when sglang is not importable, so callers can fall back or say so.
Only what SGLang itself requires at its API boundary lives here (sgl-project/sglang, paths under
python/sglang/srt/): its serializer (`utils/common.py` `MultiprocessingSerializer`, a
`ForkingPickler` dump whose `deserialize` is a restricted `SafeUnpickler`), the torch reduction
patch its own callers apply first (`utils/patch_torch.py`, `patch_torch.py` in older releases),
and the flattened-bucket metadata class (`weight_sync/tensor_bucket.py` `FlattenedTensorMetadata`,
the class that unpickler accepts)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def _reduction_patch() -> Callable[[], None] | None:
    try:
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
    except ImportError:
        try:
            from sglang.srt.patch_torch import monkey_patch_torch_reductions
        except ImportError:
            return None
    patch: Callable[[], None] = monkey_patch_torch_reductions
    return patch


def serializer() -> Callable[[Any], bytes | str] | None:
    """`MultiprocessingSerializer.serialize`, applying SGLang's torch reduction patch first (CUDA IPC
    handles keyed by device UUID, as SGLang's own callers do); None without sglang."""
    try:
        from sglang.srt.utils import MultiprocessingSerializer
    except ImportError:
        return None
    patch = _reduction_patch()

    def serialize(obj: Any) -> bytes | str:
        if patch is not None:
            patch()
        out: bytes | str = MultiprocessingSerializer.serialize(obj)
        return out

    return serialize


def deserializer() -> Callable[[bytes | str], Any] | None:
    """`MultiprocessingSerializer.deserialize`; None without sglang."""
    try:
        from sglang.srt.utils import MultiprocessingSerializer
    except ImportError:
        return None
    patch = _reduction_patch()

    def deserialize(data: bytes | str) -> Any:
        if patch is not None:
            patch()
        return MultiprocessingSerializer.deserialize(data)

    return deserialize


def flattened_tensor_metadata_class() -> type | None:
    """SGLang's `FlattenedTensorMetadata`; None without sglang."""
    try:
        from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorMetadata
    except ImportError:
        return None
    cls: type = FlattenedTensorMetadata
    return cls
