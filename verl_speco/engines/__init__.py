"""Serving integrations: vLLM (vllm_engine, the only vllm importer), SGLang contract checks, acceptance metrics."""
