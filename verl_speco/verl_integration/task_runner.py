"""`SpecoTaskRunner`: verl's `TaskRunnerV1` running our trainer; `run` is verl's PPO entry with it.
`TaskRunnerV1.run` resolves its trainer inside the method, so `SpecoTaskRunner.run` repeats its few steps
with `speco_trainer_cls(...)` (the contract test pins them) and the drafter section parsed once."""

from __future__ import annotations

from pprint import pprint
from typing import Any

import ray
from omegaconf import DictConfig, OmegaConf
from verl.trainer.main_ppo import TaskRunnerV1, run_ppo

from verl_speco.verl_integration.config_bridge import USER_KEY, drafter_from_actor_rollout_ref

_verl_runner: Any = TaskRunnerV1
_BaseRunner: Any = _verl_runner.__ray_actor_class__  # the plain class behind verl's @ray.remote


class SpecoTaskRunner(_BaseRunner):
    """verl's V1 task runner with `Speco<Trainer>` (see the module docstring)."""

    def run(self, config: DictConfig) -> None:
        import transfer_queue as tq
        from verl.trainer.ppo.v1 import get_trainer_cls
        from verl.utils.logging_utils import configure_verl_logging

        from verl_speco.verl_integration.trainer import speco_trainer_cls

        configure_verl_logging()
        drafter = drafter_from_actor_rollout_ref(config.actor_rollout_ref)
        trainer_cls = speco_trainer_cls(get_trainer_cls(config.trainer.v1.trainer_mode))
        config.transfer_queue.enable = True
        pprint(OmegaConf.to_container(config, resolve=True))
        OmegaConf.resolve(config)
        self.config = config
        tq.init(config.transfer_queue)
        succeeded = False
        try:
            self.trainer = trainer_cls(config=config, drafter=drafter)
            self.trainer.init()
            self.init_agent_loop_manager()
            self.trainer.fit(self.agent_loop_manager)
            succeeded = True
        finally:
            try:
                tracking = getattr(self.trainer, "logger", None)
                if tracking is not None:
                    tracking.finish(exit_code=0 if succeeded else 1)
            finally:
                tq.close()


def run(config: DictConfig) -> None:
    """verl's `run_ppo` (Ray init, runner actor, wait) with `SpecoTaskRunner`, on a config that went
    through `config_bridge.prepare_config` (the drafter section moved out of verl's rollout section)."""
    if not config.trainer.use_v1:
        raise ValueError("trainer.use_v1: got False, expected True (verl-speco drives verl's v1 trainers only)")
    if "drafter" in config.actor_rollout_ref.rollout:
        raise ValueError(f"{USER_KEY}: still in verl's rollout section, expected it moved by "
                         "config_bridge.prepare_config (verl_speco.main.prepare) before run")
    run_ppo(config, task_runner_class=ray.remote(SpecoTaskRunner))
