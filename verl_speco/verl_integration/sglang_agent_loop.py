"""SGLang rollout capture inside a verl run, without patching SGLang or verl: verl 0.9.1's
`SGLangHttpServer.generate` returns no hidden states, so the capture flags go into
`rollout.engine_kwargs.sglang` and `SpecoSGLangCaptureAgentLoop` (verl's single-turn loop) sends its generate
to the same server's `/generate` with `return_hidden_states`; the version gate covers the verl internals used."""

from __future__ import annotations

import asyncio
import re
from typing import Any, cast

import verl
from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop
from verl.workers.rollout.replica import TokenOutput

from verl_speco.engines.sglang_capture import RolloutCapturePlan
from verl_speco.engines.sglang_http import SGLangHTTPClient
from verl_speco.online.config import CaptureCaps, DrafterConfigError, floating_dtype
from verl_speco.online.rollout_capture import RolloutCapture, RolloutResponse

VERL_RELEASES = ("0.9.1",)  # releases whose LLMServerClient / router internals were read for this
AGENT_LOOP_NAME = "speco_sglang_capture"
CAPTURE_KEY = "speco_rollout_capture"  # extra_fields key: RolloutCapture.encode bytes
_ADDRESS = re.compile(r"^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9.\-]+):\d{1,5}$")


def require_verl_release(version: str) -> None:
    if version not in VERL_RELEASES:
        raise DrafterConfigError(
            f"actor_rollout_ref.rollout.drafter.capture_source=rollout: verl {version} is installed; the SGLang "
            f"capture agent loop uses verl internals checked on {list(VERL_RELEASES)} only")


def agent_loop_config(plan: RolloutCapturePlan, hidden_size: int, hidden_dtype: str, timeout_s: float) -> list[dict]:
    """The entry of verl's `agent_loop_config_path` file that names our loop and its settings."""
    return [{"name": AGENT_LOOP_NAME, "_target_": f"{__name__}.SpecoSGLangCaptureAgentLoop",
             "capture_plan": {"family": plan.family, "mode": plan.mode, "layer_ids": list(plan.layout.layer_ids),
                              "last_hidden": plan.layout.last_hidden,
                              "sglang_layer_ids": list(plan.sglang_layer_ids), "convention": plan.convention},
             "capture_hidden_size": int(hidden_size), "capture_hidden_dtype": hidden_dtype,
             "capture_timeout_s": float(timeout_s)}]


def plan_from_dict(d: Any) -> RolloutCapturePlan:
    from feature_store import Layout

    return RolloutCapturePlan(str(d["family"]), str(d["mode"]),
                              Layout(layer_ids=tuple(int(i) for i in d["layer_ids"]), last_hidden=str(d["last_hidden"])),
                              tuple(int(i) for i in d["sglang_layer_ids"]),
                              None if d["convention"] is None else str(d["convention"]))


def sglang_request(prompt_ids: list[int], sampling_params: dict[str, Any], rollout: Any) -> dict[str, Any]:
    """The `/generate` body verl 0.9.1's `SGLangHttpServer.generate` builds for these arguments, without the
    capture fields."""
    params = dict(sampling_params)
    if "max_new_tokens" in params:
        budget = int(params.pop("max_new_tokens"))
    elif "max_tokens" in params:
        budget = int(params.pop("max_tokens"))
    else:
        budget = min(int(rollout.response_length),
                     int(rollout.prompt_length) + int(rollout.response_length) - len(prompt_ids))
    max_model_len = rollout.get("max_model_len", None) if hasattr(rollout, "get") else None
    if max_model_len is not None:
        room = int(max_model_len) - len(prompt_ids) - 1
        if room < 0:
            raise ValueError(f"Prompt length ({len(prompt_ids)}) exceeds the model's maximum context length "
                             f"({int(max_model_len)}).")
        budget = min(budget, room)
    params["max_new_tokens"] = max(0, budget)
    return_logprob = bool(params.pop("logprobs", False))
    return {"sampling_params": params, "return_logprob": return_logprob}


class SGLangCaptureClient:
    """Stands in for verl's `LLMServerClient` inside one agent loop: the same server, the request with the
    capture fields, the reply as verl's `TokenOutput` with the capture in `extra_fields[CAPTURE_KEY]`."""

    def __init__(self, inner: Any, rollout: Any, capture: RolloutCapture, timeout_s: float) -> None:
        require_verl_release(verl.__version__)
        self.inner, self.rollout, self.capture, self.timeout_s = inner, rollout, capture, float(timeout_s)
        self.global_steps: int | None = None  # the trajectory's step (kwargs["global_steps"]), if verl gives one

    async def generate(self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any],
                       image_data: Any = None, video_data: Any = None, audio_data: Any = None,
                       **kwargs: Any) -> TokenOutput:
        if image_data is not None or video_data is not None or audio_data is not None:
            raise DrafterConfigError("actor_rollout_ref.rollout.drafter.capture_source=rollout: multimodal inputs "
                                     "are not captured from the rollout; use capture_source=actor")
        body = sglang_request(list(prompt_ids), sampling_params, self.rollout)
        server_id, _ = await self.inner._acquire_server(request_id, prompt_ids=prompt_ids,
                                                        sampling_params=sampling_params)
        try:
            if not isinstance(server_id, str) or not _ADDRESS.match(server_id):
                raise DrafterConfigError(f"rollout capture: the load balancer's server id {server_id!r} is not a "
                                         "host:port HTTP address (a custom router_config_path?)")
            client = SGLangHTTPClient(f"http://{server_id}", timeout_s=self.timeout_s)
            reply = await asyncio.to_thread(client.generate, [int(t) for t in prompt_ids], body["sampling_params"],
                                            return_logprob=body["return_logprob"], rid=request_id,
                                            **self.capture.plan.request_fields())
        finally:
            self.inner._release_server(server_id, request_id=request_id)
        meta = reply["meta_info"]
        token_ids = [int(t) for t in reply["output_ids"]]
        log_probs = None
        if body["return_logprob"]:
            pairs = meta.get("output_token_logprobs") or []
            log_probs = [float(p[0]) for p in pairs] if len(pairs) == len(token_ids) else []
            token_ids = token_ids if len(pairs) == len(token_ids) else []  # verl drops a mismatched reply too
        finish = meta.get("finish_reason")
        encoded = self.capture.encode(RolloutResponse(list(prompt_ids), token_ids, meta))
        steps = self.global_steps
        return TokenOutput(token_ids=token_ids, log_probs=log_probs,
                           stop_reason=finish.get("type") if isinstance(finish, dict) else None,
                           extra_fields={"global_steps": steps, "min_global_steps": steps, "max_global_steps": steps,
                                         CAPTURE_KEY: encoded})


class SpecoSGLangCaptureAgentLoop(SingleTurnAgentLoop):
    """verl's single-turn agent loop whose generate call captures hidden states (module docstring)."""

    def __init__(self, *args: Any, capture_plan: Any, capture_hidden_size: int, capture_hidden_dtype: str,
                 capture_timeout_s: float = 600.0, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        capture = RolloutCapture(plan_from_dict(capture_plan), int(capture_hidden_size), CaptureCaps(),
                                 hidden_dtype=floating_dtype(capture_hidden_dtype, "capture_hidden_dtype"))
        self.speco_client = SGLangCaptureClient(self.server_manager, self.rollout_config, capture, capture_timeout_s)
        self.server_manager = cast(Any, self.speco_client)  # what SingleTurnAgentLoop.run calls generate on

    async def run(self, sampling_params: dict[str, Any], **kwargs: Any) -> Any:
        steps = kwargs.get("global_steps")
        self.speco_client.global_steps = None if steps is None else int(steps)
        return await super().run(sampling_params, **kwargs)
