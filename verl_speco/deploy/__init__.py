"""Deployment lines and their checks: the versions file (`versions`), start-up refusals
(`engine_check`), vllm-ascend's facts (`vllm_ascend`), image constraints (`image_constraints`) and
the support table (`support`). The vLLM source scanners the tests use live in tests/deploy/."""
