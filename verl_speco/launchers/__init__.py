"""The body every Qwen3-8B launcher in scripts/ runs (`python -m verl_speco.launchers`).

- `recipes`: per family and device, the drafter settings, the drafted tokens k and whether an engine
  serves the pair (our engine formats, the CPU platform's limits, the versions file's refusals).
- `online`: the verl-speco overrides of online co-training, engine settings included.
- `separate`: the two-stage workflow (collect_only GRPO into a Feature Store, then offline training).
- `cli`: environment and flags -> a printed, checked or executed command.
"""
