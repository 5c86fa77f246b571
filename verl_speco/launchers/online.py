"""Online co-training: the verl-speco overrides of GRPO with a drafter captured from the updated actor,
trained while the next rollout runs and published live into the rollout servers (DEVICE=cpu: the
embedded target). The engine settings are explicit (`engine_overrides`; docs/design/engines.md section 8)."""

from __future__ import annotations

from typing import Any

from verl_speco.launchers import recipes
from verl_speco.launchers.inputs import Inputs

DRAFTER = "actor_rollout_ref.rollout.drafter"
ROLLOUT = "actor_rollout_ref.rollout"
MAX_NUM_SEQS = 256
MAX_BATCHED_TOKENS = 8192
GRAPH_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
V2_ONLY = ("dspark",)  # vLLM 0.32 serves these in its V2 model runner only
EAGER_DRAFT = ("dflash", "dspark")  # the publish replaces derived draft buffers (module docstring)
FULL_DECODE_ONLY = ("dflash", "dspark")  # block drafters: vllm-ascend's graph mode for them
GPU_MEMORY_UTILIZATION = {"gpu": 0.6, "npu": 0.7}


def hydra_value(value: Any) -> str:
    """A Python value as a Hydra override value."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, list | tuple):
        return "[" + ",".join(hydra_value(v) for v in value) + "]"
    if isinstance(value, str):
        return value if value and all(c.isalnum() or c in "._-/~" for c in value) else repr(value)
    raise recipes.RecipeError(f"setting value {value!r}: expected null, a bool, number, string or list")


def settings_overrides(section: str, values: dict[str, Any]) -> list[str]:
    """`+<section>.settings.<key>=<value>` per setting (the schema's settings start empty)."""
    return [f"+{section}.settings.{key}={hydra_value(value)}" for key, value in sorted(values.items())]


def capture_sizes(k: int) -> list[int]:
    """vLLM CUDA-graph capture sizes in tokens: (k + 1) x batch, within the scheduler's limits."""
    q = k + 1
    return [q * b for b in GRAPH_BATCHES if b <= MAX_NUM_SEQS and q * b <= MAX_BATCHED_TOKENS]


def grpo_overrides(inputs: Inputs, engine: str, device: str = "gpu") -> list[str]:
    """GRPO on a Qwen3-8B-class target (GPU or NPU), the part every family and workflow shares."""
    return [
        "algorithm.adv_estimator=grpo",
        f"data.train_files={hydra_value(inputs.train_files)}", f"data.val_files={hydra_value(inputs.val_files)}",
        "data.train_batch_size=192", "data.max_prompt_length=1024", "data.max_response_length=4096",
        "data.filter_overlong_prompts=true",
        f"actor_rollout_ref.model.path={hydra_value(inputs.model)}",
        "actor_rollout_ref.model.use_remove_padding=true", "actor_rollout_ref.model.enable_gradient_checkpointing=true",
        "actor_rollout_ref.actor.optim.lr=1e-6", "actor_rollout_ref.actor.ppo_mini_batch_size=48",
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4", "actor_rollout_ref.actor.use_kl_loss=true",
        "actor_rollout_ref.actor.kl_loss_coef=0.001", "actor_rollout_ref.actor.fsdp_config.param_offload=false",
        f"{ROLLOUT}.name={engine}", f"{ROLLOUT}.n=4", f"{ROLLOUT}.tensor_model_parallel_size=2",
        f"{ROLLOUT}.gpu_memory_utilization={GPU_MEMORY_UTILIZATION[device]}",
        f"{ROLLOUT}.log_prob_micro_batch_size_per_gpu=8",
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=8",
        "trainer.logger=[console,tensorboard]", "trainer.project_name=verl_speco",
        f"trainer.n_gpus_per_node={inputs.rl_gpus}", "trainer.nnodes=1", "trainer.save_freq=50",
        "trainer.test_freq=10", "trainer.total_epochs=1", f"trainer.device={'npu' if device == 'npu' else 'cuda'}",
    ]


def drafter_overrides(family: str, device: str, mode: str) -> list[str]:
    """The drafter's family, settings and k (the same for both workflows and both stages)."""
    values = recipes.settings(family, device)
    k = recipes.speculative_tokens(family, values)
    return [f"{DRAFTER}.enable=true", f"{DRAFTER}.family={family}", f"{DRAFTER}.mode={mode}",
            f"{DRAFTER}.num_speculative_tokens={k}", *settings_overrides(DRAFTER, values)]


def engine_overrides(family: str, engine: str, k: int, device: str = "gpu") -> list[str]:
    """The GPU and NPU engine settings of the module docstring."""
    common = [f"{ROLLOUT}.enforce_eager=false", f"{ROLLOUT}.max_num_seqs={MAX_NUM_SEQS}"]
    if engine == "sglang":
        return common
    runner = "1" if family in V2_ONLY and device == "gpu" else "0"
    out = [*common, f"{ROLLOUT}.max_num_batched_tokens={MAX_BATCHED_TOKENS}",
           f"{ROLLOUT}.cudagraph_capture_sizes={hydra_value(capture_sizes(k))}",
           f"+ray_kwargs.ray_init.runtime_env.env_vars.VLLM_USE_V2_MODEL_RUNNER='{runner}'"]
    if family in EAGER_DRAFT:
        out.append(f"+{ROLLOUT}.engine_kwargs.vllm.speculative_config.enforce_eager=true")
    if device == "npu":
        mode = "FULL_DECODE_ONLY" if family in FULL_DECODE_ONLY else "FULL_AND_PIECEWISE"
        out.append(f"+{ROLLOUT}.engine_kwargs.vllm.compilation_config.cudagraph_mode={mode}")
    elif family in V2_ONLY:
        out.append(f"+{ROLLOUT}.engine_kwargs.vllm.compilation_config.cudagraph_mode=PIECEWISE")
    return out


def online_overrides(family: str, engine: str, device: str, inputs: Inputs) -> list[str]:
    """GPU, NPU: the `verl-speco` overrides. CPU: the overrides `cpu_port.launch` appends to its preset."""
    drafter = drafter_overrides(family, device, "online")
    if device == "cpu":
        return [*drafter, f"trainer.experiment_name=cpu_grpo_{family}"]
    k = recipes.speculative_tokens(family, recipes.settings(family, device))
    return [
        *grpo_overrides(inputs, engine, device), *drafter,
        f"{DRAFTER}.model_path={hydra_value(inputs.draft_path)}", f"{DRAFTER}.schedule=overlap",
        f"{DRAFTER}.capture_pass=post_update", f"{DRAFTER}.num_workers={inputs.drafter_gpus}",
        f"{DRAFTER}.num_gpus=1", f"{DRAFTER}.train_steps_per_round=16", f"{DRAFTER}.micro_batch_size=8",
        f"{DRAFTER}.publish_dir={hydra_value(inputs.publish_dir)}", f"{DRAFTER}.caps.max_rows=64",
        f"{DRAFTER}.caps.max_tokens=65536", f"{DRAFTER}.caps.max_seq_len=5120",
        *engine_overrides(family, engine, k, device),
        f"trainer.experiment_name=qwen3_8b_grpo_{family}_{engine}{'_npu' if device == 'npu' else ''}",
    ]
