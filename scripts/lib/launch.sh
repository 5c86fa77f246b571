#!/usr/bin/env bash
# The one body of the Qwen3-8B launchers (scripts/run_qwen3_8b_*.sh): each passes its workflow and
# drafter family, this runs `python -m verl_speco.launchers` from the repository root. The family
# recipes, the engine settings for speculative decoding and the device selection (DEVICE=gpu|cpu;
# npu is refused) live in verl_speco/launchers/. Inputs and flags:
#   .venv/bin/python -m verl_speco.launchers --help
# --print prints the commands, --check validates their configs; neither starts anything.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
PYTHON=${PYTHON:-.venv/bin/python}
if [ "${DEVICE:-gpu}" = cpu ]; then
    export HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=1 TOKENIZERS_PARALLELISM=false
fi
exec "$PYTHON" -m verl_speco.launchers "$@"
