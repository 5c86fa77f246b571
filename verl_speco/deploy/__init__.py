"""Deployment lines and their checks: the versions file (`versions`), start-up refusals
(`engine_check`), the vLLM source check (`vllm_tree`, `vllm_uses`, `vllm_families`) and the support
table (`support`)."""
