#!/usr/bin/env bash
# GPU run: GRPO on Qwen3-8B with an EAGLE-3 drafter co-trained online, rollout on vLLM or SGLang
# (ENGINE). Rows are captured by one forward of the updated actor after each update
# (capture_pass=post_update), the drafter trains on its own GPUs (DRAFTER_GPUS Ray actors, FSDP2
# over them) while the next rollout runs (schedule=overlap), and every version is published live
# into the rollout servers (vLLM: worker-extension reload; SGLang: update_weights_from_tensor with
# selector=draft). One node: RL_GPUS for verl + DRAFTER_GPUS = the node's GPUs. Overrides only;
# every key exists in configs/speco_trainer.yaml (tests/verl/test_launchers.py composes them).
#   ENGINE=sglang MODEL=/models/Qwen3-8B TRAIN_FILES=~/data/gsm8k/train.parquet bash scripts/run_qwen3_8b_eagle3.sh
# Extra Hydra overrides are appended: ... trainer.total_training_steps=20
set -euo pipefail
cd "$(dirname "$0")/.."

ENGINE=${ENGINE:-vllm}
case "$ENGINE" in
    vllm|sglang) ;;
    *) echo "ENGINE=$ENGINE: expected vllm or sglang" >&2; exit 2 ;;
esac
MODEL=${MODEL:-Qwen/Qwen3-8B}
TRAIN_FILES=${TRAIN_FILES:-$HOME/data/gsm8k/train.parquet}
VAL_FILES=${VAL_FILES:-$HOME/data/gsm8k/test.parquet}
DRAFT_PATH=${DRAFT_PATH:-null}
PUBLISH_DIR=${PUBLISH_DIR:-/dev/shm/verl_speco/qwen3_8b_eagle3_$ENGINE}
RL_GPUS=${RL_GPUS:-6}
DRAFTER_GPUS=${DRAFTER_GPUS:-2}
PYTHON=${PYTHON:-.venv/bin/python}

exec "$PYTHON" -m verl_speco.main \
    algorithm.adv_estimator=grpo \
    data.train_files="$TRAIN_FILES" \
    data.val_files="$VAL_FILES" \
    data.train_batch_size=192 \
    data.max_prompt_length=1024 \
    data.max_response_length=4096 \
    data.filter_overlong_prompts=true \
    actor_rollout_ref.model.path="$MODEL" \
    actor_rollout_ref.model.use_remove_padding=true \
    actor_rollout_ref.model.enable_gradient_checkpointing=true \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.actor.ppo_mini_batch_size=48 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 \
    actor_rollout_ref.actor.use_kl_loss=true \
    actor_rollout_ref.actor.kl_loss_coef=0.001 \
    actor_rollout_ref.actor.fsdp_config.param_offload=false \
    actor_rollout_ref.rollout.name="$ENGINE" \
    actor_rollout_ref.rollout.n=4 \
    actor_rollout_ref.rollout.tensor_model_parallel_size=2 \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6 \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=8 \
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8 \
    actor_rollout_ref.rollout.drafter.enable=true \
    actor_rollout_ref.rollout.drafter.algorithm=eagle3 \
    actor_rollout_ref.rollout.drafter.mode=online \
    actor_rollout_ref.rollout.drafter.model_path="$DRAFT_PATH" \
    actor_rollout_ref.rollout.drafter.num_speculative_tokens=3 \
    actor_rollout_ref.rollout.drafter.schedule=overlap \
    actor_rollout_ref.rollout.drafter.capture_pass=post_update \
    actor_rollout_ref.rollout.drafter.num_workers="$DRAFTER_GPUS" \
    actor_rollout_ref.rollout.drafter.num_gpus=1 \
    actor_rollout_ref.rollout.drafter.train_steps_per_round=16 \
    actor_rollout_ref.rollout.drafter.micro_batch_size=8 \
    actor_rollout_ref.rollout.drafter.publish_dir="$PUBLISH_DIR" \
    actor_rollout_ref.rollout.drafter.caps.max_rows=64 \
    actor_rollout_ref.rollout.drafter.caps.max_tokens=65536 \
    actor_rollout_ref.rollout.drafter.caps.max_seq_len=5120 \
    trainer.logger='["console","tensorboard"]' \
    trainer.project_name=verl_speco \
    trainer.experiment_name=qwen3_8b_grpo_eagle3_"$ENGINE" \
    trainer.n_gpus_per_node="$RL_GPUS" \
    trainer.nnodes=1 \
    trainer.save_freq=50 \
    trainer.test_freq=10 \
    trainer.total_epochs=1 \
    "$@"
