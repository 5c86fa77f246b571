#!/usr/bin/env bash
# The project's test command (README "Run the tests"; .ci/run calls it).
# Builds/refreshes .venv, then runs lint, type checks and the whole pytest suite
# (including real vLLM CPU engine tests and torchrun gloo tests), then the real verl GRPO runs on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
# each phase's wall time, printed at the end (also when a phase fails)
PHASES=()
phase_start=$SECONDS
phase_done() { PHASES+=("$1=$((SECONDS - phase_start))s"); phase_start=$SECONDS; }
trap 'echo "[run_tests] phase times: ${PHASES[*]:-none} (total ${SECONDS}s)"' EXIT
bash scripts/setup_env.sh
phase_done setup
export HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=1 TOKENIZERS_PARALLELISM=false
.venv/bin/ruff check feature_store drafters verl_speco tests scripts benchmarks experiments
phase_done ruff
.venv/bin/mypy
phase_done mypy
.venv/bin/python -m pytest -q -ra --durations=40 -m "not cpu_grpo" "$@"
phase_done pytest
# The real verl GRPO runs on the CPU platform (tests/verl/test_cpu_grpo.py) run after the rest and
# alone: each takes both cores for a minute or two. Skipped when a selection is passed.
if [ $# -eq 0 ]; then
  .venv/bin/python -m pytest -q -ra -m cpu_grpo tests/verl/test_cpu_grpo.py tests/verl/test_separate_training_cpu.py
  phase_done cpu_grpo
fi
