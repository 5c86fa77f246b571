"""vLLM serving for targets and drafters: the only module importing vllm (lazily, inside functions).

On CPU, tests set `VLLM_ENABLE_V1_MULTIPROCESSING=0` (engine in-process, ~3 s start),
`HF_HUB_OFFLINE=1` and `VLLM_CPU_KVCACHE_SPACE=1` (GiB) before building an engine.

Acceptance counters come from vLLM's Prometheus registry (`llm.get_metrics()`), which is global
to the process: building a second `LLM` unregisters the first one's counters. Read an engine's
metrics while it is the newest one, and take per-run figures as the difference of two
snapshots (`snapshot_spec_counters` before, `read_spec_metrics(llm, since=...)` after).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from drafters.registry import vllm_methods
from verl_speco.engines.spec_metrics import SpecCounters, acceptance_summary

if TYPE_CHECKING:
    from vllm import LLM

DRAFT_METHODS = vllm_methods()  # from the drafter catalog
# The vLLM releases whose internals the in-place draft reload below (DraftReloadMixin, the layer-wise
# reload, the DFlash and P-EAGLE rebuilds) was checked against: 0.32.0 served in CI; 0.24.0 (verl
# 0.9.1's pin) and 0.23.0 (vllm-ascend 0.23.0's vLLM) by reading their source
# (tests/deploy/test_vllm_source.py; what the reload reaches of vllm-ascend's own runner, proposers
# and DFlash patch: tests/deploy/test_vllm_ascend_source.py). Any other release is refused.
PATCHED_VLLM = ("0.32.0", "0.24.0", "0.23.0")
# Families vLLM 0.32 cannot serve on its CPU platform -> why (docs/design/engines.md sections 1.2 and 3)
CPU_UNSERVABLE = {  # family -> why vLLM cannot serve it here (its export is checked another way)
    "dspark": "vLLM 0.32's V1 model runner (the only one on CPU) refuses dspark, and V2 needs Triton",
    "domino": "vLLM 0.32 has no Domino (it would serve the backbone as plain DFlash); SGLang serves it, on CUDA only",
}
CPU_UNSERVABLE_SHORT = {  # the same reasons in a few words (the benchmark tables' cells)
    "dspark": "V1 runner refuses it, V2 needs Triton", "domino": "vLLM 0.32 has no Domino",
}
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


def context_length(longest_prompt: int, max_new_tokens: int, num_speculative_tokens: int) -> int:
    """The `max_model_len` an engine needs so that its drafter runs on EVERY step of a generation of
    up to `max_new_tokens` tokens after prompts of at most `longest_prompt` tokens, k =
    `num_speculative_tokens` drafts per step (any method; plain decoding needs less).

    vLLM 0.32 (`GPUModelRunner._input_fits_in_drafter`, used by the CPU runner too) drafts only when
    `max_seq_len + k (+ 1 for DFlash's bonus query) <= max_model_len`, with `max_seq_len` the
    longest sequence of the whole batch in that verification step. When it does not fit, the drafter
    is skipped for EVERY request of the batch and each gets k drafts of token id 0, which are
    scheduled, verified and counted (k draft tokens, almost never accepted). A request that has
    generated g tokens verifies a sequence of P + g + k tokens, and its last verification has
    g = max_new_tokens - 1, so the drafter needs P + max_new_tokens - 1 + 2k tokens of context, one
    more for DFlash: P + max_new_tokens + 2k covers every method. Sized as P + max_new_tokens + k + 1
    (enough for the target alone; too short for k >= 2), the drafter was skipped for the whole batch
    on the last one or two steps of the longest-prompt request, and every other request still
    running lost a round of drafts there: vLLM's acceptance fell below the reference decoder's
    (docs/results/smollm2/README.md).

    Worked example: prompts of at most 131 tokens, 64 new tokens, k = 3 -> 131 + 64 + 6 = 201.
    """
    if longest_prompt < 1 or max_new_tokens < 1 or num_speculative_tokens < 0:
        raise ValueError(f"context_length: got longest_prompt={longest_prompt}, max_new_tokens={max_new_tokens}, "
                         f"num_speculative_tokens={num_speculative_tokens}; expected >= 1, >= 1 and >= 0")
    return longest_prompt + max_new_tokens + 2 * num_speculative_tokens


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
    import vllm
    from vllm import LLM

    from verl_speco.cpu_port import install_cpu_port
    from verl_speco.deploy.engine_check import require_vllm_spec

    kwargs: dict[str, Any] = {
        "model": str(target_dir), "tokenizer": str(target_dir), "dtype": dtype,
        "max_model_len": max_model_len, "max_num_seqs": max_num_seqs, "seed": seed,
        "enforce_eager": True, "disable_log_stats": False,
        "speculative_config": speculative_config(draft_dir, method, num_speculative_tokens,
                                                 **(speculative_extra or {})),
    }
    kwargs.update(llm_kwargs)
    require_vllm_spec(kwargs["speculative_config"], str(vllm.__version__))  # e.g. DSpark on vLLM 0.24
    install_cpu_port()  # vllm-cpu 0.32's fixes A, B, C (bug C: a second engine after numba was imported)
    if draft_dir is not None and method == "dflash":
        _require_in_process_core()
    return LLM(**kwargs)


def _require_in_process_core() -> None:
    """vllm-cpu 0.32's DFlash context k_norm bug (verl_speco/cpu_port/vllm_dflash.py) is fixed in
    this process only: an engine core in a subprocess would serve the unfixed model."""
    import os

    from vllm.platforms import current_platform

    if current_platform.is_cpu() and os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") != "0":
        raise ValueError("VLLM_ENABLE_V1_MULTIPROCESSING: got "
                         f"{os.environ.get('VLLM_ENABLE_V1_MULTIPROCESSING', '<unset, default 1>')!r}, expected '0' "
                         "for a DFlash draft on vLLM's CPU platform: the context k_norm fix (bug B, "
                         "verl_speco/cpu_port/vllm_dflash.py) only reaches an in-process engine core")


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

    A publish never takes the live draft down:
      1. it is verified completely before the model is touched (`publish.verify_version`: manifest,
         version and directory, every bucket's size and checksum, names, shapes and dtypes equal to
         the checkpoint the engine started its draft from, finite weights; and no tensor of it lands
         in a module the draft shares with the target, `_speco_target_owned`); a refused one changes
         nothing and is answered with its reason;
      2. the verified tensors are held in host memory (one copy of the draft, checkpoint names);
         any failure once the reload has started ends the reload and reloads the version held
         before (or the start-up checkpoint): the previous version keeps serving, bit for bit.
         A plain copy of the old parameters would not do: on CPU the linear layers serve from
         weights repacked while loading, which only a reload rebuilds.
    `speco_reapply_draft` reloads the held copy too, so it never depends on a version directory
    that the publisher may have pruned since.
    Every answer is `{"status": "loaded" | "stale" | "rejected" | "failed", "version": <held after>,
    "reason": <why, "" when loaded>}`; the counts are in `speco_draft_stats()`.

    Reload: vLLM's layer-wise reload (`initialize_layerwise_reload`, `load_weights` bucket by
    bucket, `finalize_layerwise_reload` under the engine's config). A plain `load_weights` is not
    enough on CPU, where linear layers repack their weights after loading. State vLLM derives from
    the weights outside that reload is rebuilt after it: DFlash's fused context K/V buffers
    (`_rebuild_dflash_buffers`) and P-EAGLE's mask-slot state (`mask_hidden` and fc(mask_hidden),
    `_parallel_drafting_mask`, `_load_mask_hidden`, `_refresh_parallel_drafting_hidden`).
    """

    model_runner: Any

    def _speco_state(self) -> dict[str, Any]:
        state: dict[str, Any] = self.__dict__.setdefault(
            "_speco", {"version": -1, "path": None, "loads": 0, "dropped": 0, "rejected": 0, "failed": 0,
                       "last_reason": "", "held": None})
        return state

    def _speco_drafter(self) -> Any:
        """The model runner's draft proposer, the object holding the draft `model`: `drafter` in
        vLLM's V1 model runner (`vllm/v1/worker/gpu_model_runner.py`, and the CPU runner built on
        it), `speculator` in the V2 runner (`vllm/v1/worker/gpu/model_runner.py`, the only one
        serving DSpark); both names in 0.32.0 and 0.24.0."""
        runner = self.model_runner
        for proposer in (getattr(runner, "drafter", None), getattr(runner, "speculator", None)):
            if getattr(proposer, "model", None) is not None:
                return proposer
        found = ", ".join(f"{name}={type(getattr(runner, name)).__name__}" for name in ("drafter", "speculator")
                          if hasattr(runner, name)) or "neither attribute"
        raise RuntimeError(
            f"speco_load_draft: this engine has no draft model: its model runner ({type(runner).__name__}) has no "
            f"`drafter` (vLLM's V1 runner) or `speculator` (V2 runner) holding a `model` (found: {found}); start it "
            "with a speculative_config that loads a draft model (a drafter family's method, not ngram)")

    def _speco_draft_model(self) -> Any:
        return self._speco_drafter().model

    def _speco_start_dir(self) -> Path | None:
        """The draft checkpoint directory the engine started from (None: not a local directory)."""
        draft = Path(str(getattr(self.model_runner.vllm_config.speculative_config, "model", "") or ""))
        return draft if draft.is_dir() else None

    def _speco_expected(self) -> dict[str, Any] | None:
        """(shape, dtype) per checkpoint name of the start-up draft checkpoint (None when that is not
        a local directory: then only the version's own consistency is checked)."""
        state = self._speco_state()
        if "expected" not in state:
            from verl_speco.online.publish import checkpoint_spec

            start = self._speco_start_dir()
            state["expected"] = checkpoint_spec(start) if start is not None else None
        expected: dict[str, Any] | None = state["expected"]
        return expected

    def _speco_target_owned(self) -> dict[str, str]:
        """Checkpoint-name prefixes of the draft's modules that ARE the target's modules -> the
        target's name for them. vLLM shares the target's embedding with an EAGLE draft that has
        none, and its LM head when the draft checkpoint gave no `lm_head` of its own (e.g. the
        engine started with `load_format=dummy`) or one equal to the target's. A reload must never
        write into those: it would overwrite the policy's own weights.

        A module of the draft's own whose parameter IS a target parameter counts too: a target with
        tied embeddings (SmolLM2, small Llamas) has one tensor behind `lm_head.weight` and
        `model.embed_tokens.weight`, so a draft head tied to it writes into the target's embedding.

        Example: the draft's `lm_head` is the target's `lm_head` -> {"lm_head": "lm_head"}; its
        `model.embed_tokens` is the target's `model.embed_tokens` -> {"embed_tokens": "model.embed_tokens"};
        its own `lm_head` module holds the tied target's embedding weight -> {"lm_head": "lm_head =
        model.embed_tokens"} (every target name of that tensor)."""
        target = getattr(self.model_runner, "model", None)
        if target is None:
            return {}
        target_modules = {id(m): name for name, m in target.named_modules()}
        target_params: dict[int, list[str]] = {}
        for pname, param in target.named_parameters(remove_duplicate=False):
            target_params.setdefault(id(param), []).append(pname.rsplit(".", 1)[0])
        owned: dict[str, str] = {}
        draft = self._speco_draft_model()
        for name, module in draft.named_modules():
            if name and id(module) in target_modules:
                owned[name.removeprefix("model.")] = target_modules[id(module)]
        for pname, param in draft.named_parameters(remove_duplicate=False):
            if id(param) in target_params:
                owned.setdefault(pname.rsplit(".", 1)[0].removeprefix("model."),
                                 " = ".join(sorted(set(target_params[id(param)]))))
        return owned

    def _speco_check_not_target_owned(self, names: list[str]) -> None:
        from verl_speco.online.publish import PublishRejected

        owned = self._speco_target_owned()
        hits = sorted(f"{n} -> target {owned[p]}" for n in names for p in owned if n.startswith(p + "."))
        if hits:
            raise PublishRejected(
                "shared", f"the publish would write into tensors the target owns ({', '.join(hits)}): vLLM shares "
                          "them with the draft because its start-up checkpoint gave it none of its own "
                          "(load_format=dummy, or a draft head equal to the target's). Start the rollout with "
                          "load_format=auto and a draft checkpoint with its own lm_head")

    def _speco_held(self) -> list[list[tuple[str, torch.Tensor]]] | None:
        """The tensors of what serves now: the held version, else the start-up checkpoint."""
        state = self._speco_state()
        if state["held"] is not None:
            held: list[list[tuple[str, torch.Tensor]]] = state["held"]
            return held
        start = self._speco_start_dir()
        if start is None:
            return None
        from safetensors.torch import load_file

        return [list(load_file(str(f)).items()) for f in sorted(start.glob("*.safetensors"))]

    def _speco_reload(self, buckets: Any) -> None:
        """vLLM's layer-wise reload of the draft from `buckets` (lists of (name, tensor))."""
        refused = _reload_refusal()
        if refused is not None:
            raise RuntimeError(refused)
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload import (
            finalize_layerwise_reload,
            initialize_layerwise_reload,
        )

        model = self._speco_draft_model()
        config = self.model_runner.vllm_config
        mask, layer_buckets = _parallel_drafting_mask(model, buckets)  # (None, buckets) unless P-EAGLE
        with (set_current_vllm_config(config), torch.no_grad(), _deferred_dflash_buffers(model),
              _mask_hidden_left_to_us(model, mask is not None)):
            initialize_layerwise_reload(model)
            try:
                for bucket in layer_buckets:
                    model.load_weights(bucket)
            except BaseException:
                _end_reload(model, config.speculative_config.draft_model_config)
                raise
            finalize_layerwise_reload(model, config.speculative_config.draft_model_config)
            if mask is not None:
                _load_mask_hidden(model, mask)
                _refresh_parallel_drafting_hidden(self._speco_drafter())
        _rebuild_dflash_buffers(model, buckets)

    def _speco_verified(self, path: str, version: int) -> list[list[tuple[str, torch.Tensor]]]:
        """The buckets of version `version` at `path`, verified completely (`publish.verify_version`,
        nothing the target owns) before anything reaches the model; `PublishRejected` otherwise."""
        from verl_speco.online.publish import verified_buckets, verify_version

        manifest = verify_version(path, int(version), self._speco_expected())
        self._speco_check_not_target_owned([n for b in manifest["buckets"] for n in b["names"]])
        return list(verified_buckets(path, manifest))

    def _speco_apply(self, buckets: list[list[tuple[str, torch.Tensor]]]) -> None:
        """Reload from verified `buckets`; on any failure, reload what served before, then re-raise."""
        try:
            self._speco_reload(buckets)
        except BaseException:
            previous = self._speco_held()
            if previous is not None:
                self._speco_reload(previous)
            raise

    def _speco_answer(self, status: str, reason: str = "") -> dict[str, Any]:
        state = self._speco_state()
        if status != "loaded":
            state["last_reason"] = reason
        return {"status": status, "version": int(state["version"]), "reason": reason}

    def speco_load_draft(self, path: str, version: int) -> dict[str, Any]:
        """Load version `version` from `path` when it is newer and verifies (class docstring)."""
        from verl_speco.online.publish import PublishRejected, stale_reason

        state = self._speco_state()
        refused = _reload_refusal()
        if refused is not None:  # a vLLM release the reload was not checked against: nothing is touched
            state["rejected"] += 1
            return self._speco_answer("rejected", f"vllm_version: {refused}")
        stale = stale_reason(int(version), state["version"])
        if stale is not None:
            state["dropped"] += 1
            return self._speco_answer("stale", stale)
        try:
            buckets = self._speco_verified(path, version)
        except PublishRejected as e:
            state["rejected"] += 1
            return self._speco_answer("rejected", f"{e.reason}: {e}")
        try:
            self._speco_apply(buckets)
        except Exception as e:  # what served before is back (_speco_apply)
            state["failed"] += 1
            return self._speco_answer("failed", f"{type(e).__name__}: {e} (previous version {state['version']} "
                                                "restored)")
        state.update(version=int(version), path=str(path), loads=state["loads"] + 1, held=buckets)
        return self._speco_answer("loaded")

    def speco_reapply_draft(self) -> int:
        """Re-load the held version from host memory (no-op before the first publish); its version."""
        state = self._speco_state()
        if state["held"] is not None:
            self._speco_check_not_target_owned([n for b in state["held"] for n, _ in b])
            self._speco_reload(state["held"])
        return int(state["version"])

    def speco_apply_baseline(self, path: str, version: int) -> dict[str, Any]:
        """Serve a fixed reference draft (e.g. the run's initial one) for one measurement, verified like a
        publish but outside the version order: the held version and its host copy are untouched, and
        `speco_restore_draft` brings them back. Answers like `speco_load_draft`; "loaded" here means
        the baseline serves."""
        from verl_speco.online.publish import PublishRejected

        refused = _reload_refusal()
        if refused is not None:
            return self._speco_answer("rejected", f"vllm_version: {refused}")
        try:
            buckets = self._speco_verified(path, version)
        except PublishRejected as e:
            return self._speco_answer("rejected", f"{e.reason}: {e}")
        try:
            self._speco_apply(buckets)
        except Exception as e:  # what served before is back (_speco_apply)
            return self._speco_answer("failed", f"{type(e).__name__}: {e} (the held draft restored)")
        return self._speco_answer("loaded")

    def speco_restore_draft(self) -> int:
        """Reload what serves outside a baseline measurement: the held version, else the start-up
        checkpoint; its version (-1: the start-up checkpoint)."""
        held = self._speco_held()
        if held is not None:
            self._speco_check_not_target_owned([n for b in held for n, _ in b])
            self._speco_reload(held)
        return int(self._speco_state()["version"])

    def speco_draft_version(self) -> int:
        return int(self._speco_state()["version"])

    def speco_draft_stats(self) -> dict[str, Any]:
        """Version, path, loads, dropped stale / rejected / failed publishes, the last reason, and a
        digest of the live draft tensors."""
        import hashlib

        digest = hashlib.sha256()
        model = self._speco_draft_model()
        live = dict(model.state_dict())
        if isinstance(getattr(model, MASK_HIDDEN, None), torch.Tensor):  # a non-persistent buffer: not in it
            live[MASK_HIDDEN] = getattr(model, MASK_HIDDEN)
        mask_state = getattr(self._speco_drafter(), "parallel_drafting_hidden_state_tensor", None)
        if mask_state is not None:  # what the proposer puts at mask slots (fc(mask_hidden))
            live["drafter.parallel_drafting_hidden_state_tensor"] = mask_state
        for name, tensor in sorted(live.items()):
            digest.update(name.encode())
            digest.update(tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
        stats = {k: v for k, v in self._speco_state().items() if k not in ("expected", "held")}
        return {**stats, "digest": digest.hexdigest()}


def _reload_refusal() -> str | None:
    """Why this process's vLLM may not run the draft reload (None: a PATCHED_VLLM release)."""
    import vllm

    from verl_speco.deploy.engine_check import patch_refusal

    return patch_refusal("the in-place draft reload (DraftReloadMixin)", PATCHED_VLLM, str(vllm.__version__))


@contextmanager
def _deferred_dflash_buffers(model: Any) -> Iterator[None]:
    """Make vLLM's DFlash `_build_fused_kv_buffers` a no-op while a layer-wise reload runs: every
    `load_weights` call ends with it, and a bucket that completes only some layers leaves the
    others on meta placeholders ("Tensor on device meta is not on the expected device cpu",
    measured). `_rebuild_dflash_buffers` builds them once the reload is done."""
    inner: Any = getattr(model, "model", None)
    if not callable(getattr(inner, "_build_fused_kv_buffers", None)):
        yield
        return
    inner._build_fused_kv_buffers = lambda: None  # an instance attribute shadows the method
    try:
        yield
    finally:
        del inner._build_fused_kv_buffers


def _rebuild_dflash_buffers(model: Any, buckets: Any) -> None:
    """Rebuild the buffers vLLM 0.32's DFlash derives from its weights, from the reloaded tensors.

    `DFlashQwen3ForCausalLM.load_weights` ends with `model._build_fused_kv_buffers()`: one fused
    context K/V projection (the k/v rows of every layer's qkv_proj), the stacked k_norm weights and
    an alias of `hidden_norm.weight`. Under the layer-wise reload a layer is finalised (on CPU:
    its linear weights repacked, `qkv_proj.weight` left EMPTY) as soon as its tensors are in, so
    that call reads empty or previous-version storage: measured on vllm-cpu, the first draft step
    after a publish fails with "size mismatch, got input (96), mat (96x128), vec (0)". Here the
    fused weight is rebuilt from the checkpoint tensors just loaded (names as our export writes
    them, an optional "model." prefix) and the norm buffers from the installed norm weights.
    No-op for any other draft model."""
    inner: Any = getattr(model, "model", None)
    if not callable(getattr(inner, "_build_fused_kv_buffers", None)):
        return
    tensors = {name.removeprefix("model."): t for bucket in buckets for name, t in bucket}
    layers = list(inner.layers)
    dtype, device = inner.hidden_norm.weight.dtype, inner.hidden_norm.weight.device  # the held copy is on the host
    rows, biases = [], []
    for i in range(len(layers)):
        p = f"layers.{i}.self_attn."
        try:
            rows += [tensors[p + "k_proj.weight"], tensors[p + "v_proj.weight"]]
        except KeyError as err:
            raise RuntimeError(f"DFlash reload: tensor {err.args[0]!r} missing from the published draft "
                               "(the fused context K/V projection needs every layer's k_proj and v_proj)") from None
        if p + "k_proj.bias" in tensors:
            biases += [tensors[p + "k_proj.bias"], tensors[p + "v_proj.bias"]]
    inner._fused_kv_weight = torch.cat(rows, dim=0).to(device, dtype).contiguous()  # [L * 2 * kv_size, H]
    inner._fused_kv_bias = torch.cat(biases, dim=0).to(device, dtype).contiguous() if biases else None
    inner._k_norm_weights = torch.stack([layer.self_attn.k_norm.weight.data for layer in layers]).contiguous()
    inner._hidden_norm_weight = inner.hidden_norm.weight.data


MASK_HIDDEN = "mask_hidden"  # vLLM's parallel-drafting EAGLE-3 buffer (P-EAGLE's learned pre-fc mask-slot state)


def _parallel_drafting_mask(model: Any, buckets: Any) -> tuple[torch.Tensor | None, list[list[tuple[str, torch.Tensor]]]]:
    """For a parallel-drafting EAGLE-3 draft (P-EAGLE): the published `mask_hidden` and the buckets
    without it; (None, the buckets) for any other draft.

    vLLM 0.32's `Eagle3LlamaForCausalLM.load_weights` (llama_eagle3.py, as Qwen3's) handles
    `mask_hidden` outside the layer-wise loader: `self.mask_hidden.copy_(loaded_weight.view(1, -1))`
    (l. 440), and raises "mask_hidden not found in weights but model is configured for parallel
    drafting" for any call whose iterable lacks it (l. 450-455). So a publish of more than one
    bucket failed on the first bucket without it (measured: status "failed", that ValueError),
    and in one bucket the copy went into the meta placeholder the layer-wise reload had put in
    the buffer's place, and the buffer came back with the OLD value at finalize (non-persistent,
    never loaded through a weight loader: `_copy_and_restore_kernel_tensors` skips it): measured,
    the engine kept the start-up mask_hidden. Here it is taken out of the buckets, vLLM is told not
    to expect it (`_mask_hidden_left_to_us`) and it is written once the reload is done
    (`_load_mask_hidden`)."""
    buckets = [list(bucket) for bucket in buckets]
    if not (getattr(model, "use_parallel_drafting", False) and isinstance(getattr(model, MASK_HIDDEN, None),
                                                                          torch.Tensor)):
        return None, buckets
    masks = [t for bucket in buckets for name, t in bucket if MASK_HIDDEN in name]  # vLLM's own test
    if len(masks) != 1:
        raise RuntimeError(f"parallel-drafting reload: {len(masks)} {MASK_HIDDEN!r} tensors in the published "
                           "draft, expected exactly 1 (vLLM drafts its mask slots from it)")
    want = getattr(model, MASK_HIDDEN).numel()
    if masks[0].numel() != want:
        raise RuntimeError(f"parallel-drafting reload: {MASK_HIDDEN} has {masks[0].numel()} elements, expected "
                           f"{want} (k aux layers x target hidden size, the pre-fc width)")
    rest = [[(name, t) for name, t in bucket if MASK_HIDDEN not in name] for bucket in buckets]
    return masks[0], [bucket for bucket in rest if bucket]


@contextmanager
def _mask_hidden_left_to_us(model: Any, active: bool) -> Iterator[None]:
    """While the buckets load, vLLM's `load_weights` neither demands nor copies `mask_hidden`: its
    `use_parallel_drafting` (read only by `load_weights`) is off, then back on."""
    if not active:
        yield
        return
    model.use_parallel_drafting = False
    try:
        yield
    finally:
        model.use_parallel_drafting = True


def _load_mask_hidden(model: Any, mask: torch.Tensor) -> None:
    """What vLLM's load_weights does with it, into the live buffer (the reload has put it back)."""
    buffer = getattr(model, MASK_HIDDEN)
    if buffer.is_meta:
        raise RuntimeError(f"parallel-drafting reload: {MASK_HIDDEN} is still a meta placeholder after the reload")
    buffer.copy_(mask.view(1, -1))


def _refresh_parallel_drafting_hidden(drafter: Any) -> None:
    """Recompute the hidden state vLLM's proposer puts at mask slots from the weights now loaded.

    vLLM 0.32's proposer computes it ONCE, in `load_model` (v1/spec_decode/llm_base_proposer.py
    l. 1401-1414): `parallel_drafting_hidden_state_tensor.copy_(model.combine_hidden_states(
    mask_hidden))` (= fc(mask_hidden) for EAGLE-3), and every draft step reads that copy. A publish
    that changes fc or mask_hidden would otherwise leave the engine drafting its mask slots with
    the OLD fc(mask_hidden) (outputs stay lossless, acceptance at positions >= 2 is the old
    draft's: tests/engines/test_vllm_publish.py). Mirrors vLLM's code and its conditions."""
    state = getattr(drafter, "parallel_drafting_hidden_state_tensor", None)
    if not (getattr(drafter, "parallel_drafting", False) and getattr(drafter, "pass_hidden_states_to_model", False)
            and state is not None):
        return
    flat = drafter.model.mask_hidden.view(-1)
    if getattr(drafter, "eagle3_use_aux_hidden_state", False):
        state.copy_(drafter.model.combine_hidden_states(flat))
    else:
        state.copy_(flat)


def _end_reload(model: Any, draft_config: Any) -> None:
    """Leave vLLM's layer-wise reload after a failure: every layer back on its own (kernel) tensors,
    loaders unwrapped. `finalize_layerwise_reload` does exactly that for layers that loaded nothing
    or all; if it fails on a half-loaded layer, put the saved kernel tensors back directly."""
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, layerwise

    try:
        finalize_layerwise_reload(model, draft_config)
        return
    except Exception:
        pass
    for layer in model.modules():
        info = layerwise.get_layerwise_info(layer)
        if info.kernel_tensors is not None:
            for tensor in layerwise.get_layer_tensors(layer).values():
                setattr(tensor, "weight_loader", layerwise._get_original_loader(tensor))  # noqa: B010
            layerwise._place_kernel_tensors(layer, info)
        info.reset()
    layerwise.LOADING_LAYERS.clear()


def publish_draft(llm: LLM, path: str | Path, version: int) -> list[dict[str, Any]]:
    """Send a published version to every worker of `llm` (started with `DRAFT_EXTENSION`); the
    workers' answers (`DraftReloadMixin`: status, version held after, reason).

    `LLM.generate` is synchronous, so calling this between generate calls swaps the draft with
    no request in flight."""
    return list(llm.collective_rpc("speco_load_draft", args=(str(path), int(version))))


def draft_stats(llm: LLM) -> list[dict[str, Any]]:
    """Per-worker `DraftReloadMixin.speco_draft_stats()`."""
    return list(llm.collective_rpc("speco_draft_stats"))


def reload_target(llm: LLM, target_dir: str | Path) -> None:
    """The target's own weight sync: reload the target model in place from `target_dir`, then
    re-apply the latest published draft (its embedding is shared with the target)."""
    llm.collective_rpc("reload_weights", kwargs={"weights_path": str(target_dir)})
    llm.collective_rpc("speco_reapply_draft")
