#!/usr/bin/env bash
# The prepared GPU check for one H100/H200 with CUDA torch and triton, no network and no vLLM:
# scripts/gpu_check.py runs a training step of every drafter family on CUDA in bf16 with flex
# attention (block masks checked against the dense masks on the GPU), FSDP2 over NCCL with one rank,
# at Qwen3-8B draft shapes, then the named checks of benchmarks/device_checks.py. Each family and
# check runs under its own timeout in a worker process; its row is printed and written to --json as
# soon as it finishes. Needs only torch, numpy and safetensors besides this repository.
# Exit status 0 when every unit passed within the time budget (--budget-s, default 480 s).
#   bash scripts/gpu_check.sh [--families dflash,dspark] [--checks ''] [--json report.json]
#   PYTHON=.venv/bin/python bash scripts/gpu_check.sh --device cpu --tiny   # the CPU smoke run (CI)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
missing=$("$PYTHON" - <<'PY'
import importlib.util
print(" ".join(n for n in ("torch", "numpy", "safetensors") if importlib.util.find_spec(n) is None))
PY
)
if [ -n "$missing" ]; then
    echo "gpu_check.sh: missing Python modules: $missing (expected torch with numpy and safetensors)" >&2
    exit 2
fi
exec "$PYTHON" scripts/gpu_check.py "$@"
