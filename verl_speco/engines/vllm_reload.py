"""Live draft publishing into a running vLLM engine: the worker side (`DraftReloadMixin`, a vLLM
worker extension that reloads the draft in place) and the engine side (`publish_draft`,
`draft_stats`, `reload_target`). It patches vLLM internals (the layer-wise reload, the DFlash and
P-EAGLE buffers), so it names the releases it was checked against and refuses any other."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from vllm import LLM

# The vLLM releases whose internals the in-place draft reload below (DraftReloadMixin, the layer-wise
# reload, the DFlash and P-EAGLE rebuilds) was checked against: 0.32.0 served in CI; 0.24.0 (verl
# 0.9.1's pin) and 0.23.0 (vllm-ascend 0.23.0's vLLM) by reading their source
# (tests/deploy/test_vllm_source.py; what the reload reaches of vllm-ascend's own runner, proposers
# and DFlash patch: tests/deploy/test_vllm_ascend_source.py). Any other release is refused.
PATCHED_VLLM = ("0.32.0", "0.24.0", "0.23.0")

DRAFT_EXTENSION = "verl_speco.engines.vllm_reload.DraftReloadMixin"


class DraftReloadMixin:
    """vLLM worker-extension methods that reload the draft in place from a published version
    (`worker_extension_cls=DRAFT_EXTENSION`, called through `collective_rpc`). Versions only move forward;
    a version is verified completely and held in host memory before the model is touched, so a failed
    reload restores the previous one bit for bit (docs/design/engines.md section 1.5)."""

    model_runner: Any

    def _speco_state(self) -> dict[str, Any]:
        state: dict[str, Any] = self.__dict__.setdefault(
            "_speco", {"version": -1, "path": None, "loads": 0, "dropped": 0, "rejected": 0, "failed": 0,
                       "last_reason": "", "held": None})
        return state

    def _speco_drafter(self) -> Any:
        """The model runner's draft proposer, the object holding the draft `model`: `drafter` in
        vLLM's V1 model runner, `speculator` in the V2 runner (the only one serving DSpark)."""
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
        """Checkpoint-name prefixes of draft modules that ARE or hold a target parameter -> the target's
        name(s) (vLLM shares the embedding and, without a draft head, the LM head): never reloaded into."""
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
        publish but outside the version order; `speco_restore_draft` brings the held version back."""
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

    from verl_speco.deploy.versions import patch_refusal

    return patch_refusal("the in-place draft reload (DraftReloadMixin)", PATCHED_VLLM, str(vllm.__version__))


@contextmanager
def _deferred_dflash_buffers(model: Any) -> Iterator[None]:
    """Make vLLM's DFlash `_build_fused_kv_buffers` a no-op while a layer-wise reload runs (every
    `load_weights` call ends with it, and would read the meta placeholders of layers a bucket has
    not completed); `_rebuild_dflash_buffers` builds them once the reload is done."""
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
    """Rebuild the buffers vLLM's DFlash (and DSpark) derives from its weights (`_build_fused_kv_buffers`:
    every layer's K/V rows of `qkv_proj.weight`, k_norm, `hidden_norm`), into the tensors vLLM holds when
    shapes allow. No-op for any other draft or without a fused weight."""
    inner: Any = getattr(model, "model", None)
    if not callable(getattr(inner, "_build_fused_kv_buffers", None)):
        return
    tensors = {name.removeprefix("model."): t for bucket in buckets for name, t in bucket}
    attns = [layer.self_attn for layer in inner.layers]
    dtype, device = inner.hidden_norm.weight.dtype, inner.hidden_norm.weight.device  # the held copy is on the host
    if getattr(inner, "_fused_kv_weight", True) is not None:  # absent (never built) or vLLM's fused path
        weight = torch.cat([_rank_kv_rows(a, tensors, i, "weight") for i, a in enumerate(attns)])
        inner._fused_kv_weight = _into(getattr(inner, "_fused_kv_weight", None), weight.to(device, dtype))
        bias = (torch.cat([_rank_kv_rows(a, tensors, i, "bias") for i, a in enumerate(attns)]).to(device, dtype)
                if attns[0].qkv_proj.bias is not None else None)
        inner._fused_kv_bias = _into(getattr(inner, "_fused_kv_bias", None), bias)
    k_norms = torch.stack([a.k_norm.weight.data for a in attns])  # [L, head_dim], replicated on every rank
    inner._k_norm_weights = _into(getattr(inner, "_k_norm_weights", None), k_norms)
    inner._hidden_norm_weight = inner.hidden_norm.weight.data


def _rank_kv_rows(attn: Any, tensors: dict[str, torch.Tensor], layer: int, kind: str) -> torch.Tensor:
    """This TP rank's k and v rows of layer `layer`'s `qkv_proj.<kind>` ([2 * kv_size, H] or [2 * kv_size]):
    the installed rows, else the published k_proj/v_proj narrowed as `QKVParallelLinear.weight_loader` does."""
    proj = attn.qkv_proj
    installed = getattr(proj, kind)
    if installed.dim() >= 1 and installed.shape[0] == attn.q_size + 2 * attn.kv_size:
        return installed[attn.q_size:]
    size = attn.kv_size
    start = proj.tp_rank // proj.num_kv_head_replicas * size
    rows = []
    for part in ("k_proj", "v_proj"):
        name = f"layers.{layer}.self_attn.{part}.{kind}"
        if name not in tensors:
            raise RuntimeError(f"DFlash reload: tensor {name!r} missing from the published draft (the fused "
                               "context K/V projection needs every layer's k_proj and v_proj)")
        if tensors[name].shape[0] < start + size:
            raise RuntimeError(f"DFlash reload: {name} has {tensors[name].shape[0]} rows, expected at least "
                               f"{start + size} (tensor-parallel rank {proj.tp_rank}'s {size} rows from {start})")
        rows.append(tensors[name].narrow(0, start, size))
    return torch.cat(rows)


def _into(held: Any, new: torch.Tensor | None) -> torch.Tensor | None:
    """`new`'s values in `held` when `held` is a tensor of its shape, dtype and device (the object
    vLLM's code already references stays valid), else `new` itself."""
    if (new is not None and isinstance(held, torch.Tensor) and held.shape == new.shape and held.dtype == new.dtype
            and held.device == new.device and not held.is_meta):
        held.copy_(new)
        return held
    return new


MASK_HIDDEN = "mask_hidden"  # vLLM's parallel-drafting EAGLE-3 buffer (P-EAGLE's learned pre-fc mask-slot state)


def _parallel_drafting_mask(model: Any, buckets: Any) -> tuple[torch.Tensor | None, list[list[tuple[str, torch.Tensor]]]]:
    """For a P-EAGLE draft: the published `mask_hidden` and the buckets without it, else (None, buckets):
    vLLM 0.32's `load_weights` copies `mask_hidden` outside the layer-wise loader and raises for a call
    without it, so it is written after the reload (`_load_mask_hidden`)."""
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
    """Recompute the hidden state vLLM's proposer puts at mask slots (fc(mask_hidden), computed once in
    vLLM 0.32's `load_model`) from the weights now loaded, mirroring vLLM's code and conditions."""
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
    workers' answers (status, version held after, reason). Between `LLM.generate` calls (synchronous)
    no request is in flight."""
    return list(llm.collective_rpc("speco_load_draft", args=(str(path), int(version))))


def draft_stats(llm: LLM) -> list[dict[str, Any]]:
    """Per-worker `DraftReloadMixin.speco_draft_stats()`."""
    return list(llm.collective_rpc("speco_draft_stats"))


def reload_target(llm: LLM, target_dir: str | Path) -> None:
    """The target's own weight sync: reload the target model in place from `target_dir`, then
    re-apply the latest published draft (its embedding is shared with the target)."""
    llm.collective_rpc("reload_weights", kwargs={"weights_path": str(target_dir)})
    llm.collective_rpc("speco_reapply_draft")
