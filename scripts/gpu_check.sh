#!/usr/bin/env bash
# The prepared GPU check for one H100/H200 with CUDA torch, triton and transformers, no network and no
# vLLM: scripts/gpu_check.py runs a training step of every drafter family on CUDA in bf16 with flex
# attention (block masks checked against the dense masks on the GPU), FSDP2 over NCCL with one rank,
# at Qwen3-8B draft shapes, and prints per-family step time, peak memory and model FLOP utilisation.
# Exit status 0 when every check passed within the time budget (--budget-s, default 480 s).
#   bash scripts/gpu_check.sh [--families dflash,dspark] [--json report.json]
#   WHEELS=DIR bash scripts/gpu_check.sh          # installs DIR's wheels first (no index), off site-packages
#   bash scripts/gpu_check.sh --fetch-wheels DIR   # on a machine with an index: the wheels WHEELS needs
#   PYTHON=.venv/bin/python bash scripts/gpu_check.sh --device cpu --tiny   # the CPU smoke run (CI)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
# pure-Python dependencies beyond torch, triton and transformers (which bring numpy, pyyaml,
# safetensors and tqdm); the versions are .venv's (tests/scripts/test_gpu_check.py keeps them equal)
WHEEL_PINS=(omegaconf==2.3.1 antlr4-python3-runtime==4.9.3)
if [ "${1:-}" = --fetch-wheels ]; then
    "$PYTHON" -m pip download --no-deps -d "${2:?--fetch-wheels DIR}" "${WHEEL_PINS[@]}"
    exit 0
fi
if [ -n "${WHEELS:-}" ]; then
    "$PYTHON" -m pip install -q --no-index --no-deps --find-links "$WHEELS" --target .gpu_check_deps "${WHEEL_PINS[@]}"
    export PYTHONPATH=".gpu_check_deps${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
missing=$("$PYTHON" - <<'PY'
import importlib.util
names = ("torch", "omegaconf", "safetensors", "numpy", "yaml", "tqdm")
print(" ".join(n for n in names if importlib.util.find_spec(n) is None))
PY
)
if [ -n "$missing" ]; then
    echo "gpu_check.sh: missing Python modules: $missing (expected CUDA torch with transformers; the rest from" \
         "WHEELS=DIR, filled by: bash scripts/gpu_check.sh --fetch-wheels DIR)" >&2
    exit 2
fi
exec "$PYTHON" scripts/gpu_check.py "$@"
