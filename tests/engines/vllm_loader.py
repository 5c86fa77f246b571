"""Build one of vLLM's own draft model classes on CPU and run its `load_weights` on an export's tensors,
outside any engine: the shared set-up of the DFlash and DSpark loader tests.

The class is built inside `set_current_vllm_config` and, unless the process already has one, a
one-process gloo model-parallel group. Every parameter starts as NaN, so a parameter the loader never
wrote shows; `consumed` lists the export tensor names in the order vLLM drew them.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from verl_speco.ports import free_port


@dataclass
class LoadedDraft:
    model: Any  # the vLLM draft class instance, weights loaded
    tensors: dict[str, torch.Tensor]  # the export's model.safetensors
    consumed: list[str]  # export tensor names, in the order the loader drew them


@contextmanager
def loaded_by_vllm(model_cls: type, vllm_config: Any, draft_dir: Path) -> Iterator[LoadedDraft]:
    """`model_cls(vllm_config=...)`, NaN-filled, then `load_weights` over `draft_dir/model.safetensors`."""
    from safetensors.torch import load_file
    from vllm.config import set_current_vllm_config
    from vllm.distributed import (
        cleanup_dist_env_and_memory,
        init_distributed_environment,
        initialize_model_parallel,
    )
    from vllm.distributed.parallel_state import model_parallel_is_initialized

    ours = not model_parallel_is_initialized()
    with set_current_vllm_config(vllm_config):
        if ours:
            init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                         distributed_init_method=f"tcp://127.0.0.1:{free_port('127.0.0.1')}")
            initialize_model_parallel(1, 1)
        try:
            model = model_cls(vllm_config=vllm_config)
            with torch.no_grad():
                for p in model.parameters():
                    p.fill_(float("nan"))
            tensors = load_file(str(Path(draft_dir) / "model.safetensors"))
            consumed: list[str] = []

            def weights() -> Iterator[tuple[str, torch.Tensor]]:
                for name, t in tensors.items():
                    consumed.append(name)
                    yield name, t

            with torch.no_grad():
                model.load_weights(weights())
            yield LoadedDraft(model, tensors, consumed)
        finally:
            if ours:
                cleanup_dist_env_and_memory()
