"""`drafter.speculation`: which engines take a batch-size schedule, and the speculative-config fields an
engine start gets from a calibration. `fixed` drafts `num_speculative_tokens` everywhere; `auto` gives
vLLM releases with `num_speculative_tokens_per_batch_size` the plan's schedule; unset means auto where
possible. vLLM 0.32 builds that lookup once per engine, so a schedule is planned per engine start."""

from __future__ import annotations

from typing import Any

from verl_speco.online.config import DrafterConfigError
from verl_speco.speculation.cost_model import long_tail_lengths
from verl_speco.speculation.plan import MIN_GAIN, Calibration, SpeculationPlan, plan

SPECULATION_MODES = ("fixed", "auto")
# vLLM releases whose speculative config takes a batch-size schedule (read in their source: the field,
# its validation in v1/spec_decode/dynamic/utils.py, the scheduler's lookup); 0.24 and 0.23 (vllm-ascend's)
# have neither
SCHEDULE_VLLM = ("0.32.0",)


def schedule_refusal(engine: str, version: str | None) -> str | None:
    """None when `engine` at `version` takes a batch-size schedule, else why not."""
    from verl_speco.deploy.versions import base_version

    if engine != "vllm":
        return (f"{engine}: no batch-size schedule of draft lengths (SGLang's server args take one "
                "speculative_num_steps for every batch); use drafter.speculation=fixed")
    if version is not None and base_version(version) not in SCHEDULE_VLLM:
        return (f"vLLM {version}: its speculative_config has no num_speculative_tokens_per_batch_size (vLLM "
                f"{', '.join(SCHEDULE_VLLM)} has); use drafter.speculation=fixed or a line of "
                "verl_speco/deploy/versions.toml with it")
    return None


def resolve_mode(requested: str | None, engine: str, version: str | None) -> str:
    """`requested` (None: auto where the engine takes a schedule) -> "fixed" or "auto"; ValueError naming
    the setting when auto is asked of an engine that cannot take it (`DrafterConfigError`)."""
    if requested is not None and requested not in SPECULATION_MODES:
        raise DrafterConfigError(f"actor_rollout_ref.rollout.drafter.speculation: got {requested!r}, expected one of "
                         f"{SPECULATION_MODES} or null")
    refusal = schedule_refusal(engine, version)
    if requested == "auto" and refusal is not None:
        raise DrafterConfigError(f"actor_rollout_ref.rollout.drafter.speculation: got 'auto', but {refusal}")
    if requested is None:
        return "fixed" if refusal is not None else "auto"
    return requested


def rollout_workload(requests: int, response_length: int) -> list[int]:
    """The response lengths a rollout batch is planned for when nothing measured them: `requests` lengths
    of a log-normal spread (sigma 0.9), median a quarter of `response_length`, capped at it."""
    return long_tail_lengths(requests, max(1, response_length // 4), 0.9, response_length)


def scheduled_fields(calibration_path: str, k: int, response_length: int,
                     min_gain: float = MIN_GAIN) -> tuple[dict[str, Any], SpeculationPlan]:
    """The `speculative_config` fields of the plan from `calibration_path` for a rollout batch, drafting at
    most `k`; k = 0 everywhere when drafting does not pay."""
    try:
        calibration = Calibration.read(calibration_path)
    except ValueError as err:
        raise DrafterConfigError(f"actor_rollout_ref.rollout.drafter.speculation_calibration: {err}") from err
    calibration = calibration.with_acceptance(list(calibration.per_position[:k]))
    speculation = plan(calibration, min_gain, rollout_workload(calibration.max_num_seqs, response_length))
    schedule = speculation.schedule if speculation.speculate else [(1, calibration.max_num_seqs, 0)]
    return {"num_speculative_tokens_per_batch_size": [list(r) for r in schedule]}, speculation
