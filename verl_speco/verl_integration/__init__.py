"""The verl side of online drafter co-training: the only place in verl_speco that imports verl/ray
(besides verl's CPU platform, `verl_speco.cpu_port.verl_platform`).

Modules (each imports verl lazily where it can, so `import verl_speco` never loads verl):

- `config_bridge`: moves `actor_rollout_ref.rollout.drafter` out of verl's rollout section (verl
  builds a strict `RolloutConfig` dataclass from it) into `actor_rollout_ref.speco_drafter`, and
  derives the vLLM `speculative_config`.
- `batch_rows`: maps verl's actor batches (nested/jagged or padded) and micro-batches to the
  `[B, T]` masks and token selections `verl_speco.online.capture` works on (no verl import).
- `worker`: `SpecoActorRolloutRefWorker`, verl's `ActorRolloutRefWorker` with capture hooks around
  the old-logprob pass (`compute_log_prob`) and a per-step flush (`speco_end_step`).
- `vllm_server`: `SpecoWorkerExtension` (vLLM worker extension), `SpecoVLLMHttpServer` and
  `SpecoVLLMReplica` (rollout servers that load / re-apply published drafts).
- `drafter_actor`: the drafter worker group (`DrafterWorker` Ray actors, one rank of
  `verl_speco.online.session.DrafterSession` each, FSDP2 over them), its handle `DrafterGroup` and
  `RayDrafterLink`, the group as `verl_speco.online.controller.OnlineController`'s drafter.
- `draft_servers`: the replica-side draft calls of both engines and the SGLang server mixin that
  loads published drafts through SGLang's weight-update routes.
- `trainer`: `SpecoTrainerMixin` over verl's v1 `PPOTrainer` subclasses, a thin adapter from verl's
  hooks to the `OnlineController` (schedule, rounds, publishes, metrics under `drafter/`) and to
  `trainer_setup` (around verl's `_setup`), `trainer_step` (the step's rows, fresh samples,
  held-out acceptance) and `weight_sync` (the draft loaded after every weight sync and wake-up).
- `task_runner`: `SpecoTaskRunner` (verl's `TaskRunnerV1` with our trainer) and `run`.
"""
