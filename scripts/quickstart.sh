#!/usr/bin/env bash
# README command (a): set up .venv, then run the main job on the embedded default target.
# vLLM's and the trainer's logs go to <out>/quickstart.log; --verbose or VERBOSE=1 shows them here.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
export HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=1 TOKENIZERS_PARALLELISM=false
if [ "${VERBOSE:-0}" != 0 ]; then set -- --verbose "$@"; fi
exec .venv/bin/verl-speco-quickstart "$@"
