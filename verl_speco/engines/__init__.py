"""Serving integrations: vLLM (vllm_engine: engines, generation, counters; vllm_reload: the live draft
reload; the only vllm importers besides the CPU port's fixes in verl_speco.cpu_port), SGLang contract
checks, acceptance metrics."""
