#!/usr/bin/env bash
# GRPO on Qwen3-8B with an EAGLE-2 drafter (EAGLE-1 weights; SGLang drafts a tree, vLLM 0.32 the chain) co-trained online and published live into the
# rollout servers. ENGINE=vllm|sglang (default vllm), DEVICE=gpu|cpu (default gpu; cpu: the embedded
# target at small sizes). The body is scripts/lib/launch.sh (python -m verl_speco.launchers).
#   MODEL=~/models/Qwen3-8B TRAIN_FILES=~/data/gsm8k/train.parquet bash scripts/run_qwen3_8b_eagle2.sh
# Extra Hydra overrides are appended (e.g. trainer.total_training_steps=20); --print shows the
# command, --check validates its config; the other inputs: python -m verl_speco.launchers --help.
set -euo pipefail
exec bash "$(dirname "$0")/lib/launch.sh" online --family eagle2 --engine "${ENGINE:-vllm}" --device "${DEVICE:-gpu}" "$@"
