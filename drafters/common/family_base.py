"""`DrafterFamilyBase`: the family methods every catalog entry shares, written once. A family
(docs/adding-a-family.md) names its pieces in the attributes listed in `HOOKS` and writes only
`required_layout`, `objective`, `export`, `load_export` (and `build` when it needs store statistics)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields, replace
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from drafters.common.collate import collate
from drafters.common.contract import StoreStats
from drafters.common.target import TargetHead, TargetSpec


def _set_frozen(model: nn.Module, path: str, value: Tensor) -> None:
    """Write `value` to the parameter or buffer at `path` (e.g. "embed_tokens.weight"), keeping
    its device and dtype: a parameter is copied in place (no grad), a buffer is replaced."""
    owner_path, _, attr = path.rpartition(".")
    owner = model.get_submodule(owner_path) if owner_path else model
    current = getattr(owner, attr)
    if isinstance(current, nn.Parameter):
        with torch.no_grad():
            current.copy_(value.to(current.device, current.dtype))
    else:
        setattr(owner, attr, value.to(current.device, current.dtype))


class DrafterFamilyBase:
    """The shared half of `drafters.common.contract.DrafterFamily` (module docstring)."""

    # the class attributes a family must set (contract_gaps reports the missing ones)
    HOOKS: ClassVar[tuple[str, ...]] = ("name", "label", "config_cls", "model_cls", "required", "export_cls",
                                        "proposer_cls", "mutable_settings")

    name: str
    label: str
    config_cls: type[Any]
    model_cls: type[Any]
    required: tuple[str, ...]
    export_cls: type[Any]
    proposer_cls: type[Any]
    mutable_settings: tuple[str, ...]
    target_embed: str = "embed_tokens.weight"
    target_lm_head: str = "target_lm_head"

    # -- type checks --------------------------------------------------------------------------
    def _as_config(self, cfg: Any) -> Any:
        if not isinstance(cfg, self.config_cls):
            raise TypeError(f"cfg: got {type(cfg).__name__}, expected {self.config_cls.__name__} "
                            f"(the {self.label} config)")
        return cfg

    def _as_model(self, model: nn.Module) -> Any:
        if not isinstance(model, self.model_cls):
            raise TypeError(f"model: got {type(model).__name__}, expected {self.model_cls.__name__} "
                            "(unwrap DDP/compile first)")
        cfg = getattr(model, "cfg", None)
        if not isinstance(cfg, self.config_cls):
            raise TypeError(f"model: got {type(model).__name__} with config {type(cfg).__name__}, expected a "
                            f"{self.model_cls.__name__} built by the {self.name} family ({self.config_cls.__name__})")
        return model

    # -- the shared contract methods ----------------------------------------------------------
    def resolve(self, cfg: Any, target_spec: TargetSpec) -> Any:
        return self._as_config(cfg).resolve(target_spec)

    def config_of(self, model: nn.Module) -> Any:
        return self._as_model(model).cfg

    def with_settings(self, model: nn.Module, **settings: Any) -> Any:
        """`model` with `mutable_settings` changed in its config; a key that is not a config field,
        or one that fixes the architecture, is refused naming it."""
        m = self._as_model(model)
        names = {f.name for f in fields(m.cfg)}
        unknown = sorted(set(settings) - names)
        if unknown:
            raise ValueError(f"settings {unknown} are not {self.label} settings; expected some of "
                             f"{list(self.mutable_settings)}")
        fixed = sorted(set(settings) - set(self.mutable_settings))
        if fixed:
            raise ValueError(f"settings: {fixed} cannot change a loaded {self.label} drafter (its architecture "
                             f"comes from the export); only {list(self.mutable_settings)} can")
        m.cfg = replace(m.cfg, **settings)
        return m

    def set_target_head(self, model: nn.Module, embed_tokens: Tensor, lm_head: Tensor) -> None:
        """embed_tokens [V, H] -> `target_embed`; lm_head [V, H] -> `target_lm_head` (frozen)."""
        m = self._as_model(model)
        _set_frozen(m, self.target_lm_head, lm_head)
        _set_frozen(m, self.target_embed, embed_tokens)

    def build(self, cfg: Any, target: TargetHead, store_stats: StoreStats | None = None) -> Any:
        """A fresh draft over the target's frozen pieces (`store_stats` unused: no draft vocab)."""
        return self.model_cls(self.resolve(cfg, target.spec), target)

    def engine_format(self, cfg: Any, target_spec: TargetSpec) -> Any:
        return self.export_cls.from_drafter(self._as_config(cfg), target_spec)

    def format_from_dict(self, data: Mapping[str, Any]) -> Any:
        return self.export_cls.from_dict(data)

    def required_fields(self, cfg: Any) -> tuple[str, ...]:
        return self.required

    def collate(self, samples: list[dict[str, Tensor]]) -> dict[str, Tensor]:
        missing = [f for f in self.required if samples and f not in samples[0]]
        if missing:
            raise KeyError(f"{self.label} samples: missing fields {missing} (have {sorted(samples[0])})")
        return collate(samples)

    def proposer(self, model: nn.Module, target_spec: TargetSpec) -> Any:
        m = self._as_model(model)
        if m.spec.vocab_size != target_spec.vocab_size or m.spec.hidden_size != target_spec.hidden_size:
            raise ValueError(f"proposer: model built for vocab/hidden {m.spec.vocab_size}/{m.spec.hidden_size}, "
                             f"target has {target_spec.vocab_size}/{target_spec.hidden_size}")
        return self.proposer_cls(m)
