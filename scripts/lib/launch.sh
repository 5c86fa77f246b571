#!/usr/bin/env bash
# The one body of the Qwen3-8B launchers (scripts/run_qwen3_8b_*.sh): each passes its workflow and
# drafter family, this runs `python -m verl_speco.launchers` from the repository root. The family
# recipes, the engine settings for speculative decoding and the device selection (DEVICE=gpu|npu|cpu)
# live in verl_speco/launchers/; the environment each device needs is set here. Inputs and flags:
#   python3 -m verl_speco.launchers --help
# The interpreter: PYTHON when set, else the checkout's .venv (scripts/setup_env.sh), else python3 on
# PATH (the GPU and Ascend images install verl-speco into their own interpreter and have no .venv).
# --print prints the commands, --check validates their configs; neither starts anything.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
if [ -z "${PYTHON:-}" ]; then
    if [ -x .venv/bin/python ]; then
        PYTHON=.venv/bin/python
    elif command -v python3 >/dev/null 2>&1; then
        PYTHON=python3
    else
        echo "launcher: error: no interpreter: PYTHON is unset, there is no .venv/bin/python in $PWD and no python3 on PATH" >&2
        exit 2
    fi
fi
case "${DEVICE:-gpu}" in
cpu)
    export HF_HUB_OFFLINE=1 VLLM_CPU_KVCACHE_SPACE=1 TOKENIZERS_PARALLELISM=false
    ;;
npu)
    # What the upstream Ascend launchers (verl, vllm-ascend) set; each can be overridden from outside.
    # Ray must not narrow ASCEND_RT_VISIBLE_DEVICES per worker (verl and vllm-ascend place NPUs themselves).
    export RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES="${RAY_EXPERIMENTAL_NOSET_ASCEND_RT_VISIBLE_DEVICES:-1}"
    # HCCL's host and device socket ports (a range per node, so several groups on one node never collide)
    export HCCL_HOST_SOCKET_PORT_RANGE="${HCCL_HOST_SOCKET_PORT_RANGE:-60000-60050}"
    export HCCL_NPU_SOCKET_PORT_RANGE="${HCCL_NPU_SOCKET_PORT_RANGE:-61000-61050}"
    export HCCL_OP_EXPANSION_MODE="${HCCL_OP_EXPANSION_MODE:-AIV}" STREAMS_PER_DEVICE="${STREAMS_PER_DEVICE:-32}"
    # jemalloc for the host allocator when the image has it (the Ascend images ship libjemalloc)
    for lib in /usr/lib/aarch64-linux-gnu/libjemalloc.so.2 /usr/lib/x86_64-linux-gnu/libjemalloc.so.2 \
               /usr/lib64/libjemalloc.so.2 /usr/local/lib/libjemalloc.so.2; do
        if [ -f "$lib" ]; then export LD_PRELOAD="$lib${LD_PRELOAD:+:$LD_PRELOAD}"; break; fi
    done
    ;;
esac
exec "$PYTHON" -m verl_speco.launchers "$@"
