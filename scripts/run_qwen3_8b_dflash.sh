#!/usr/bin/env bash
# GRPO on Qwen3-8B with a DFlash drafter (blocks of 16, 15 drafts) co-trained online and published live into the
# rollout servers. ENGINE=vllm|sglang (default vllm), DEVICE=gpu|cpu (default gpu; cpu: the embedded
# target at small sizes). The body is scripts/lib/launch.sh (python -m verl_speco.launchers).
#   MODEL=~/models/Qwen3-8B TRAIN_FILES=~/data/gsm8k/train.parquet bash scripts/run_qwen3_8b_dflash.sh
# Extra Hydra overrides are appended (e.g. trainer.total_training_steps=20); --print shows the
# command, --check validates its config; the other inputs: python -m verl_speco.launchers --help.
set -euo pipefail
exec bash "$(dirname "$0")/lib/launch.sh" online --family dflash --engine "${ENGINE:-vllm}" --device "${DEVICE:-gpu}" "$@"
