"""Between our drafter settings and verl's config tree: verl's strict `RolloutConfig` rejects unknown
keys, so `extract_drafter` validates `actor_rollout_ref.rollout.drafter` and moves it to
`actor_rollout_ref.speco_drafter`, which the actor workers read back (`drafter_from_actor_rollout_ref`)."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from drafters.common.contract import EngineFormat
from verl_speco.online.config import DrafterConfigError, DrafterRunConfig

logger = logging.getLogger(__name__)
USER_KEY = "actor_rollout_ref.rollout.drafter"
INTERNAL_KEY = "actor_rollout_ref.speco_drafter"
ENGINES = ("vllm", "sglang")


def drafter_to_dict(cfg: DrafterRunConfig) -> dict[str, Any]:
    return dataclasses.asdict(cfg)


def extract_drafter(config: DictConfig) -> DrafterRunConfig:
    """Validate the drafter section and move it out of verl's rollout config (idempotent)."""
    rollout = config.actor_rollout_ref.rollout
    raw: Any = None
    if "drafter" in rollout:
        raw = OmegaConf.to_container(rollout.drafter, resolve=True)
        with open_dict(rollout):
            del rollout["drafter"]
    elif "speco_drafter" in config.actor_rollout_ref:
        raw = OmegaConf.to_container(config.actor_rollout_ref.speco_drafter, resolve=True)
    if raw is not None and not isinstance(raw, dict):
        raise DrafterConfigError(f"{USER_KEY}: got {raw!r}, expected a mapping")
    drafter = DrafterRunConfig.from_dict({str(k): v for k, v in raw.items()} if raw is not None else None)
    with open_dict(config.actor_rollout_ref):
        config.actor_rollout_ref.speco_drafter = OmegaConf.create(drafter_to_dict(drafter))
    return drafter


def prepare_config(config: DictConfig) -> DrafterRunConfig:
    """What verl's `main_ppo.main` does before `run_ppo`, after moving the drafter section aside."""
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import validate_config
    from verl.utils.device import auto_set_device

    drafter = extract_drafter(config)
    auto_set_device(config)
    validate_config(config=config, use_reference_policy=need_reference_policy(config),
                    use_critic=need_critic(config))
    return drafter


def drafter_from_actor_rollout_ref(actor_rollout_ref: DictConfig | dict[str, Any]) -> DrafterRunConfig:
    """The drafter settings a worker received inside `actor_rollout_ref` (disabled when absent)."""
    node = actor_rollout_ref.get("speco_drafter")
    if node is None:
        return DrafterRunConfig()
    raw = OmegaConf.to_container(node, resolve=True) if isinstance(node, DictConfig) else dict(node)
    assert isinstance(raw, dict)
    return DrafterRunConfig.from_dict({str(k): v for k, v in raw.items()})


def rollout_engine(config: DictConfig) -> str:
    name = str(config.actor_rollout_ref.rollout.name)
    if name not in ENGINES:
        raise DrafterConfigError(f"actor_rollout_ref.rollout.name: got {name!r} with {USER_KEY}.enable=true, "
                                 f"expected one of {ENGINES}")
    return name


def speculative_engine_kwargs(fmt: EngineFormat, drafter: DrafterRunConfig, engine: str,
                              draft_dir: str, response_length: int) -> dict[str, Any]:
    """The rollout engine's speculative arguments (engine_kwargs form) for an export of `fmt` in
    `draft_dir`, with vLLM's batch-size schedule when `drafter.speculation` asks for one."""
    from verl_speco.deploy.engine_check import installed_engine_version
    from verl_speco.speculation.apply import resolve_mode, scheduled_fields

    k = int(drafter.num_speculative_tokens)
    mode = resolve_mode(drafter.speculation, engine, installed_engine_version(engine))
    if engine != "vllm":
        return fmt.sglang_server_args(draft_dir, k)
    spec = fmt.vllm_speculative_config(draft_dir, k)
    if mode == "auto" and drafter.speculation_calibration:
        fields, speculation = scheduled_fields(drafter.speculation_calibration, k, response_length)
        spec.update(fields)
        logger.warning("%s.speculation=auto: %s (planned at engine start from %s; vLLM cannot change it live)",
                       USER_KEY, speculation.describe() if speculation.speculate else
                       "k=0 at every batch size: drafting never pays here", drafter.speculation_calibration)
    elif mode == "auto":
        logger.warning("%s.speculation=auto without %s.speculation_calibration: the rollout drafts k=%s at every "
                       "batch size; measure one with `verl-speco-speculation calibrate` on this hardware",
                       USER_KEY, USER_KEY, k)
    return {"speculative_config": spec}


def apply_speculative_config(config: DictConfig, drafter: DrafterRunConfig, draft_dir: str,
                             fmt: EngineFormat) -> dict[str, Any]:
    """Write the speculative arguments into `rollout.engine_kwargs.<engine>` unless the user set them; a
    disagreeing user value fails naming both keys, a partial user `speculative_config` is completed."""
    engine = rollout_engine(config)
    wanted = speculative_engine_kwargs(fmt, drafter, engine, draft_dir,
                                       int(config.actor_rollout_ref.rollout.response_length))
    kwargs_node = config.actor_rollout_ref.rollout.engine_kwargs
    with open_dict(kwargs_node):
        if kwargs_node.get(engine) is None:
            kwargs_node[engine] = {}
        current = kwargs_node[engine]
        with open_dict(current):
            for key, value in wanted.items():
                have = current.get(key)
                if have is None:
                    current[key] = value
                    continue
                have_c = OmegaConf.to_container(have, resolve=True) if isinstance(have, DictConfig) else have
                _check_consistent(engine, key, have_c, value)
                if isinstance(have_c, dict) and isinstance(value, dict):
                    current[key] = {**value, **have_c}
    if engine == "vllm":
        draft_gets_own_head(config)
        drafter_gets_context_room(config, int(drafter.num_speculative_tokens))
    out = OmegaConf.to_container(config.actor_rollout_ref.rollout.engine_kwargs[engine], resolve=True)
    assert isinstance(out, dict)
    return {str(k): v for k, v in out.items()}


def draft_gets_own_head(config: DictConfig) -> None:
    """`actor_rollout_ref.rollout.load_format`: "dummy" (verl's default) becomes "auto" when vLLM serves a
    drafter: with dummy weights vLLM hands the EAGLE draft the TARGET's LM head, so every publish would
    overwrite the policy's head."""
    rollout = config.actor_rollout_ref.rollout
    if str(rollout.get("load_format", "dummy")) == "dummy":
        with open_dict(rollout):
            rollout.load_format = "auto"


def drafter_gets_context_room(config: DictConfig, k: int) -> None:
    """`actor_rollout_ref.rollout.max_model_len`, when the user set it, raised to prompt + response + 2k
    (`vllm_engine.context_length`, one log line): vLLM 0.32 skips the drafter for a whole batch whose
    longest sequence plus k draft queries does not fit. None (the model's maximum) is left alone."""
    from verl_speco.engines.vllm_engine import context_length

    rollout = config.actor_rollout_ref.rollout
    have = rollout.get("max_model_len")
    if have is None:
        return
    need = context_length(int(rollout.prompt_length), int(rollout.response_length), k)
    if int(have) >= need:
        return
    with open_dict(rollout):
        rollout.max_model_len = need
    logger.warning("actor_rollout_ref.rollout.max_model_len: %s raised to %s (prompt + response + 2 x %s "
                   "speculative tokens): vLLM drafts only when a step's draft queries fit", have, need, k)


def _check_consistent(engine: str, key: str, have: Any, want: Any) -> None:
    where = f"actor_rollout_ref.rollout.engine_kwargs.{engine}.{key}"
    if isinstance(want, dict) and isinstance(have, dict):
        for sub in ("method", "num_speculative_tokens"):
            if sub in have and have[sub] != want[sub]:
                raise DrafterConfigError(f"{where}.{sub}: got {have[sub]!r} but {USER_KEY} implies {want[sub]!r}; "
                                         f"drop the engine kwarg or make them agree")
        return
    if key in ("speculative_algorithm", "speculative_num_steps") and have != want:
        raise DrafterConfigError(f"{where}: got {have!r} but {USER_KEY} implies {want!r}; drop the engine "
                                 "kwarg or make them agree")
