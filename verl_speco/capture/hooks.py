"""Forward hooks that capture target hidden states from any HF decoder.

Layer ids are internal (docs/internals.md): ``0`` the embedding output, ``1 <= i < L`` the output of
decoder layer ``i - 1``, ``L`` the final-norm output (HF's ``hidden_states[L]``, equal to ``last_hidden``).
Plain module hooks, no ``output_hidden_states``: this works inside another framework's forward (verl's
old-logprob pass), under FSDP / checkpoint wrappers, padded or packed (``[1, nnz]``). Captures are detached
copies, so activations are never retained: ``FeatureCapture(model, layer_ids=(2, 4, 5))`` around a forward,
then ``cap.pop()`` -> ``aux_hidden [B, T, 3*H]``, ``last_hidden [B, T, H]``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

FINAL_NORM_NAMES = ("norm", "final_layernorm", "ln_f", "norm_f", "final_norm")


@dataclass
class DecoderModules:
    """The three places of an HF decoder the hooks attach to."""

    layers: nn.ModuleList
    final_norm: nn.Module
    layers_path: str

    @property
    def num_layers(self) -> int:
        return len(self.layers)


def _text_config(model: nn.Module) -> Any:
    config = getattr(model, "config", None)
    return getattr(config, "text_config", None) or config


def find_decoder_modules(model: nn.Module, layers_path: str | None = None,
                         norm_path: str | None = None) -> DecoderModules:
    """Find the decoder-layer list and the final norm of an HF causal LM generically (the ModuleList of
    `num_hidden_layers` whose parent holds the input embedding, and its norm), or from dotted paths."""
    modules = dict(model.named_modules())
    if layers_path is None:
        num_layers = getattr(_text_config(model), "num_hidden_layers", None)
        get_embed: Any = getattr(model, "get_input_embeddings", None)
        embed = get_embed() if callable(get_embed) else None
        candidates = []
        for name, module in modules.items():
            if not isinstance(module, nn.ModuleList) or len(module) == 0:
                continue
            if num_layers is not None and len(module) != num_layers:
                continue
            parent = modules[name.rpartition(".")[0]]
            if embed is not None and not any(m is embed for m in parent.modules()):
                continue
            candidates.append(name)
        if len(candidates) != 1:
            raise ValueError(
                f"find_decoder_modules: expected exactly one decoder layer list with "
                f"num_hidden_layers={num_layers} next to the input embedding, found {candidates}; "
                f"pass layers_path='model.layers' (or the right dotted path)")
        layers_path = candidates[0]
    if layers_path not in modules or not isinstance(modules[layers_path], nn.ModuleList):
        raise ValueError(f"find_decoder_modules: layers_path={layers_path!r} is not an nn.ModuleList "
                         f"of {type(model).__name__}")
    layers = modules[layers_path]
    assert isinstance(layers, nn.ModuleList)
    if norm_path is None:
        parent_name = layers_path.rpartition(".")[0]
        parent = modules[parent_name]
        found = [n for n in FINAL_NORM_NAMES if isinstance(getattr(parent, n, None), nn.Module)]
        if not found:
            raise ValueError(
                f"find_decoder_modules: no final norm among {FINAL_NORM_NAMES} on "
                f"{parent_name or '<root>'} ({type(parent).__name__}); pass norm_path=")
        norm_path = f"{parent_name}.{found[0]}" if parent_name else found[0]
    if norm_path not in modules:
        raise ValueError(f"find_decoder_modules: norm_path={norm_path!r} is not a module of "
                         f"{type(model).__name__}")
    return DecoderModules(layers=layers, final_norm=modules[norm_path], layers_path=layers_path)


@dataclass
class CapturedFeatures:
    """Hidden states of one forward pass. Shapes follow the model input: ``[B, T, H]`` (padded)
    or ``[1, nnz, H]`` (remove-padding), unless a ``select`` function changed them."""

    layer_ids: tuple[int, ...]
    hidden: dict[int, torch.Tensor]                 # layer id -> [B, T, H]
    last_hidden: torch.Tensor | None = None         # [B, T, H], post-final-norm

    @property
    def aux_hidden(self) -> torch.Tensor:
        """Requested layers concatenated in ``layer_ids`` order: ``[B, T, k*H]``."""
        return torch.cat([self.hidden[i] for i in self.layer_ids], dim=-1)


def _first_tensor(output: Any) -> torch.Tensor:
    """Decoder layers return a tensor (transformers >= 4.54) or a tuple with it first."""
    tensor = output[0] if isinstance(output, (tuple, list)) else output
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"FeatureCapture: hooked module returned {type(output).__name__}, expected a "
                        f"tensor or a tuple starting with one")
    return tensor


@dataclass
class FeatureCapture:
    """Context manager installing capture hooks (module docstring) on `model` (any HF decoder, possibly
    wrapped): `layer_ids` in [0, L] in `aux_hidden` order, `last_hidden`, the copies' `dtype` / `device`
    (None keeps the model's), `select` applied to every captured tensor first (e.g. pick rows)."""

    model: nn.Module
    layer_ids: Sequence[int]
    last_hidden: bool = True
    dtype: torch.dtype | None = torch.bfloat16
    device: torch.device | str | None = "cpu"
    select: Callable[[torch.Tensor], torch.Tensor] | None = None
    layers_path: str | None = None
    norm_path: str | None = None
    _handles: list[Any] = field(default_factory=list, init=False, repr=False)
    _current: dict[int | str, torch.Tensor] = field(default_factory=dict, init=False, repr=False)
    _done: list[CapturedFeatures] = field(default_factory=list, init=False, repr=False)

    def __post_init__(self) -> None:
        self.layer_ids = tuple(int(i) for i in self.layer_ids)
        if len(set(self.layer_ids)) != len(self.layer_ids):
            raise ValueError(f"FeatureCapture: layer_ids={self.layer_ids} has duplicates")

    def _store(self, key: int | str, output: torch.Tensor) -> None:
        tensor = output.detach()
        if self.select is not None:
            tensor = self.select(tensor)
        if self.dtype is not None:
            tensor = tensor.to(self.dtype)
        if self.device is not None:
            tensor = tensor.to(self.device)
        if tensor.untyped_storage().data_ptr() == output.untyped_storage().data_ptr():
            tensor = tensor.clone()              # never alias a live activation (in-place safety)
        self._current[key] = tensor

    def __enter__(self) -> FeatureCapture:
        if self._handles:
            raise RuntimeError("FeatureCapture: already entered")
        mods = find_decoder_modules(self.model, self.layers_path, self.norm_path)
        num_layers = mods.num_layers
        bad = [i for i in self.layer_ids if not 0 <= i <= num_layers]
        if bad:
            raise ValueError(f"FeatureCapture: layer_ids {bad} outside [0, {num_layers}] "
                             f"(HF hidden_states indexing for a {num_layers}-layer model)")
        want = set(self.layer_ids)

        def start_hook(_m: nn.Module, args: tuple, kwargs: dict) -> None:
            self._finish()                       # an unfinished previous forward is discarded
            if 0 in want:
                self._store(0, _first_tensor(args if args else (kwargs["hidden_states"],)))

        self._handles.append(mods.layers[0].register_forward_pre_hook(start_hook, with_kwargs=True))
        for idx in sorted(want - {0, num_layers}):
            self._handles.append(mods.layers[idx - 1].register_forward_hook(
                lambda _m, _a, out, _i=idx: self._store(_i, _first_tensor(out))))

        def norm_hook(_m: nn.Module, _a: tuple, out: Any) -> None:
            normed = _first_tensor(out)
            if num_layers in want:
                self._store(num_layers, normed)
            if self.last_hidden:
                if num_layers in want:
                    self._current["last"] = self._current[num_layers]
                else:
                    self._store("last", normed)
            self._finish(complete=True)

        self._handles.append(mods.final_norm.register_forward_hook(norm_hook))
        return self

    def _finish(self, complete: bool = False) -> None:
        if complete:
            hidden = {i: self._current[i] for i in self.layer_ids}
            last = self._current.get("last")
            self._done.append(CapturedFeatures(tuple(self.layer_ids), hidden, last))
        self._current = {}

    def __exit__(self, *exc: object) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._current = {}
        self.model = None  # type: ignore[assignment]  # drop the model reference: no leak

    def pop(self) -> CapturedFeatures:
        """The features of the single forward pass run since the last pop (error otherwise)."""
        if len(self._done) != 1:
            raise RuntimeError(f"FeatureCapture.pop: expected exactly 1 completed forward pass since "
                               f"the last pop, got {len(self._done)}; use pop_all() for several")
        return self._done.pop()

    def pop_all(self) -> list[CapturedFeatures]:
        """Features of every forward pass since the last pop, oldest first."""
        done, self._done = self._done, []
        return done


def capture_features(model: nn.Module, layer_ids: Sequence[int], **kwargs: Any) -> FeatureCapture:
    """``with capture_features(model, (2, 4, 5)) as cap: ...`` (same arguments as FeatureCapture)."""
    return FeatureCapture(model, layer_ids, **kwargs)
