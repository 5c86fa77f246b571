#!/usr/bin/env bash
# README command (a): set up .venv, then run the main job on the embedded default target.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
export HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=1 TOKENIZERS_PARALLELISM=false
exec .venv/bin/verl-speco-quickstart "$@"
