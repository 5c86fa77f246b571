#!/usr/bin/env bash
# verl-speco GRPO on the CPU platform with the embedded target, drafter co-training on (README
# "verl-speco on CPU"): builds .venv if needed, then verl_speco/cpu_port/launch.py.
# Arguments go to the launcher: [--out DIR] [--drafter DIR|fresh] [--verbose] [hydra overrides].
# verl's, Ray's and vLLM's logs go to <out>/run_cpu_grpo.log; --verbose or VERBOSE=1 shows them here.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then bash scripts/setup_env.sh; fi
export HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=1 TOKENIZERS_PARALLELISM=false
if [ "${VERBOSE:-0}" != 0 ]; then set -- --verbose "$@"; fi
exec .venv/bin/python -m verl_speco.cpu_port.launch "$@"
