"""The body every Qwen3-8B launcher in scripts/ runs (`python -m verl_speco.launchers`): `recipes` (per
family and device), `online`, `separate` (the two-stage workflow) and `cli`."""
