#!/usr/bin/env bash
# The two-stage standalone workflow on a Qwen3-8B-class target:
#   stage 1 (collect): verl GRPO with actor_rollout_ref.rollout.drafter.mode=collect_only, the actor's
#     captured features of every step written to the Feature Store FEATURE_DIR;
#   stage 2 (train): verl-speco-inspect-features FEATURE_DIR --strict, then verl-speco-draft-train
#     from that store into CKPT_DIR (resuming from its latest checkpoint).
# RUN_STAGE=both|collect|train (default both). Replace only these:
#   MODEL (target), DRAFTER (drafter family, default eagle3), TRAIN_FILES and VAL_FILES (dataset),
#   FEATURE_DIR, CKPT_DIR
#   MODEL=~/models/Qwen3-8B DRAFTER=dspark FEATURE_DIR=/data/features CKPT_DIR=/ckpt/dspark \
#       bash scripts/run_qwen3_8b_drafter_separate_training.sh
# ENGINE=vllm|sglang, DEVICE=gpu|cpu (cpu: the embedded target, small sizes, end to end); extra Hydra
# overrides go to stage 1, --train-override KEY=VALUE to stage 2; --print, --check as every launcher.
set -euo pipefail
exec bash "$(dirname "$0")/lib/launch.sh" separate --family "${DRAFTER:-eagle3}" --stage "${RUN_STAGE:-both}" \
    --engine "${ENGINE:-vllm}" --device "${DEVICE:-gpu}" "$@"
