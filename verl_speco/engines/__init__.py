"""Serving integrations: vLLM (vllm_engine, the only vllm importer besides the CPU port's fixes in
verl_speco.cpu_port), SGLang contract checks, acceptance metrics."""
