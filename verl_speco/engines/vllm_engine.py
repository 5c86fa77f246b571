"""vLLM serving for targets and drafters: the only module importing vllm (lazily, inside functions).

On CPU, tests set `VLLM_ENABLE_V1_MULTIPROCESSING=0` (engine in-process, ~3 s start),
`HF_HUB_OFFLINE=1` and `VLLM_CPU_KVCACHE_SPACE=1` (GiB) before building an engine.

Acceptance counters come from vLLM's Prometheus registry (`llm.get_metrics()`), which is global
to the process: building a second `LLM` unregisters the first one's counters. Read an engine's
metrics while it is the newest one, and take per-run figures as the difference of two
snapshots (`snapshot_spec_counters` before, `read_spec_metrics(llm, since=...)` after).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from verl_speco.engines.spec_metrics import SpecCounters, acceptance_summary

if TYPE_CHECKING:
    from vllm import LLM

DRAFT_METHODS = ("eagle3", "eagle", "draft_model", "ngram", "dflash")
_COUNTER_KEYS = {
    "vllm:spec_decode_num_drafts": "num_drafts",
    "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens",
}
_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def speculative_config(draft_dir: str | Path | None, method: str, num_speculative_tokens: int,
                       **extra: Any) -> dict[str, Any] | None:
    """The `speculative_config` dict for `LLM(...)`; None without a draft (plain decoding).

    `draft_dir` may be a native or a speculators-format export: vLLM reads either config.
    """
    if draft_dir is None and method != "ngram":
        return None
    if method not in DRAFT_METHODS:
        raise ValueError(f"method: got {method!r}, expected one of {DRAFT_METHODS}")
    if num_speculative_tokens < 1:
        raise ValueError(f"num_speculative_tokens: got {num_speculative_tokens}, expected >= 1")
    spec: dict[str, Any] = {"method": method, "num_speculative_tokens": int(num_speculative_tokens), **extra}
    if draft_dir is not None:
        spec["model"] = str(draft_dir)
    return spec


def build_llm(target_dir: str | Path, draft_dir: str | Path | None = None, method: str = "eagle3",
              num_speculative_tokens: int = 3, *, dtype: str = "float32", max_model_len: int = 512,
              max_num_seqs: int = 8, seed: int = 0, speculative_extra: dict[str, Any] | None = None,
              **llm_kwargs: Any) -> LLM:
    """A CPU-friendly `vllm.LLM` for `target_dir`, speculating with `draft_dir` when given.

    Eager mode (no compile/graphs), stats logging on (the acceptance counters need it), small
    batch and context. `llm_kwargs` override any of these. A speculators-format export passed as
    `target_dir` (no `draft_dir`) is served like `vllm serve <dir>`: vLLM loads its recorded
    verifier as the target and takes method and token count from its `speculators_config`.
    CPU attention supports head_dim in {32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512}.
    """
    from vllm import LLM

    kwargs: dict[str, Any] = {
        "model": str(target_dir), "tokenizer": str(target_dir), "dtype": dtype,
        "max_model_len": max_model_len, "max_num_seqs": max_num_seqs, "seed": seed,
        "enforce_eager": True, "disable_log_stats": False,
        "speculative_config": speculative_config(draft_dir, method, num_speculative_tokens,
                                                 **(speculative_extra or {})),
    }
    kwargs.update(llm_kwargs)
    return LLM(**kwargs)


def generate(llm: LLM, prompts_token_ids: Sequence[Sequence[int]], max_tokens: int,
             temperature: float = 0.0, *, ignore_eos: bool = True, seed: int | None = None) -> list[list[int]]:
    """Generated token ids (prompt excluded) for each prompt, in order."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    if not prompts_token_ids or any(len(p) == 0 for p in prompts_token_ids):
        raise ValueError("prompts_token_ids: expected a non-empty list of non-empty token id lists")
    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, ignore_eos=ignore_eos, seed=seed)
    prompts = [TokensPrompt(prompt_token_ids=[int(t) for t in p]) for p in prompts_token_ids]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return [list(out.outputs[0].token_ids) for out in outputs]


def snapshot_spec_counters(llm: LLM) -> SpecCounters:
    """Cumulative acceptance counters now (summed over engine labels; zeros without speculation)."""
    return _counters(llm.get_metrics())


def process_spec_counters() -> SpecCounters:
    """The same counters from this process's metrics registry: for an engine without `get_metrics`,
    e.g. the AsyncLLM inside a vLLM HTTP server (needs `disable_log_stats=False`)."""
    from vllm.v1.metrics.reader import get_metrics_snapshot

    return _counters(get_metrics_snapshot())


def _counters(metrics: Any) -> SpecCounters:
    from vllm.v1.metrics.reader import Counter, Vector

    totals = dict.fromkeys(_COUNTER_KEYS.values(), 0)
    per_pos: list[int] = []
    for metric in metrics:
        if isinstance(metric, Counter) and metric.name in _COUNTER_KEYS:
            totals[_COUNTER_KEYS[metric.name]] += int(metric.value)
        elif isinstance(metric, Vector) and metric.name == _PER_POS:
            per_pos += [0] * (len(metric.values) - len(per_pos))
            for i, v in enumerate(metric.values):
                per_pos[i] += int(v)
    return SpecCounters(accepted_per_pos=tuple(per_pos), **totals)


def read_spec_metrics(llm: LLM, since: SpecCounters | None = None) -> dict[str, Any]:
    """Acceptance figures (see `spec_metrics.acceptance_summary`) accumulated after `since`.

    Without `since`, everything this engine counted so far.
    """
    now = snapshot_spec_counters(llm)
    return acceptance_summary(now - since if since is not None else now)


def generate_with_metrics(llm: LLM, prompts_token_ids: Sequence[Sequence[int]], max_tokens: int,
                          temperature: float = 0.0, **kw: Any) -> tuple[list[list[int]], dict[str, Any]]:
    """`generate` plus the acceptance figures of exactly this call."""
    before = snapshot_spec_counters(llm)
    outputs = generate(llm, prompts_token_ids, max_tokens, temperature, **kw)
    return outputs, read_spec_metrics(llm, since=before)


def shutdown(llm: LLM) -> None:
    """Stop the engine core now (frees its KV cache) instead of waiting for garbage collection."""
    llm.llm_engine.engine_core.shutdown()


# ---------------------------------------------------------------------------------------------
# Live draft publishing: worker side (a vLLM worker extension) and engine side.

DRAFT_EXTENSION = "verl_speco.engines.vllm_engine.DraftReloadMixin"


class DraftReloadMixin:
    """vLLM worker-extension methods that reload the draft model in place from a published version.

    Pass `worker_extension_cls=DRAFT_EXTENSION` to `LLM(...)` (or mix it into another extension,
    e.g. verl's) and call the methods through `collective_rpc`. A version is a directory written
    by `verl_speco.online.publish.write_version` (bucketed safetensors; read by file handle, never
    unpickled). Versions only move forward: a publish with a version <= the loaded one is dropped.
    The path of the loaded version is kept, so `speco_reapply_draft` restores it after anything
    that rewrote the draft's memory (a sleep/wake that discarded weights, a full engine reload):
    the engine never falls back to the draft checkpoint it started from.

    Reload: vLLM's layer-wise reload (`initialize_layerwise_reload`, `load_weights` bucket by
    bucket, `finalize_layerwise_reload` under the engine's config). A plain `load_weights` is not
    enough on CPU, where linear layers repack their weights after loading.
    """

    model_runner: Any

    def _speco_state(self) -> dict[str, Any]:
        state: dict[str, Any] = self.__dict__.setdefault(
            "_speco", {"version": -1, "path": None, "loads": 0, "dropped": 0})
        return state

    def _speco_draft_model(self) -> Any:
        drafter = getattr(self.model_runner, "drafter", None)
        model = getattr(drafter, "model", None)
        if model is None:
            raise RuntimeError("speco_load_draft: this engine has no draft model (start it with a "
                               "speculative_config whose method is eagle/eagle3)")
        return model

    def _speco_apply(self, path: str) -> None:
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        from verl_speco.online.publish import iter_buckets

        model = self._speco_draft_model()
        config = self.model_runner.vllm_config
        with set_current_vllm_config(config), torch.no_grad():
            initialize_layerwise_reload(model)
            for bucket in iter_buckets(path):
                model.load_weights(bucket)
            finalize_layerwise_reload(model, config.speculative_config.draft_model_config)

    def speco_load_draft(self, path: str, version: int) -> bool:
        """Load version `version` from `path`; False (and counted) when it is not newer."""
        state = self._speco_state()
        if int(version) <= state["version"]:
            state["dropped"] += 1
            return False
        self._speco_apply(str(path))
        state.update(version=int(version), path=str(path), loads=state["loads"] + 1)
        return True

    def speco_reapply_draft(self) -> int:
        """Re-load the latest published version (no-op before the first publish); its version."""
        state = self._speco_state()
        if state["path"] is not None:
            self._speco_apply(state["path"])
        return int(state["version"])

    def speco_draft_version(self) -> int:
        return int(self._speco_state()["version"])

    def speco_draft_stats(self) -> dict[str, Any]:
        """Version, path, loads, dropped stale publishes, and a digest of the live draft tensors."""
        import hashlib

        digest = hashlib.sha256()
        for name, tensor in sorted(self._speco_draft_model().state_dict().items()):
            digest.update(name.encode())
            digest.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        return {**self._speco_state(), "digest": digest.hexdigest()}


def publish_draft(llm: LLM, path: str | Path, version: int) -> bool:
    """Send a published version to every worker of `llm` (started with `DRAFT_EXTENSION`).

    `LLM.generate` is synchronous, so calling this between generate calls swaps the draft with
    no request in flight. True when every worker loaded it; False when it was stale."""
    results = llm.collective_rpc("speco_load_draft", args=(str(path), int(version)))
    return all(bool(r) for r in results)


def draft_stats(llm: LLM) -> list[dict[str, Any]]:
    """Per-worker `DraftReloadMixin.speco_draft_stats()`."""
    return list(llm.collective_rpc("speco_draft_stats"))


def reload_target(llm: LLM, target_dir: str | Path) -> None:
    """The target's own weight sync: reload the target model in place from `target_dir`, then
    re-apply the latest published draft (its embedding is shared with the target)."""
    llm.collective_rpc("reload_weights", kwargs={"weights_path": str(target_dir)})
    llm.collective_rpc("speco_reapply_draft")
