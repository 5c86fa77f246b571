"""The DFlash family object registered in the catalog (docs/internals.md contract).

`DFlashFamily` is written over its class attributes (config, model, export config, loader,
objective, proposer), so a family on the same backbone (drafters/dspark/family.py) subclasses it
and names its own pieces instead of copying the methods."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from torch import Tensor, nn

from drafters.common.collate import collate
from drafters.common.contract import DrafterFamily, StoreStats
from drafters.common.losses import ObjectiveOutput
from drafters.common.target import TargetHead, TargetSpec
from drafters.dflash.config import DFlashConfig
from drafters.dflash.export import DFlashExportConfig, load_export
from drafters.dflash.export import export as export_model
from drafters.dflash.model import DFlashDraft
from drafters.dflash.objective import REQUIRED_FIELDS, dflash_objective
from drafters.dflash.proposer import DFlashProposer
from feature_store import Layout


class DFlashFamily:
    name = "dflash"
    label = "DFlash"  # in messages
    config_cls: type[DFlashConfig] = DFlashConfig
    model_cls: type[DFlashDraft] = DFlashDraft
    export_cls: type[DFlashExportConfig] = DFlashExportConfig
    required: tuple[str, ...] = REQUIRED_FIELDS
    # training-only choices: they shape the objective or the kernel, not the exported function
    mutable_settings: tuple[str, ...] = ("loss_gamma", "num_anchors", "attn_backend", "loss_chunk_rows")

    @staticmethod
    def _objective(model: Any, batch: dict[str, Tensor], progress: float) -> ObjectiveOutput:
        return dflash_objective(model, batch)  # no curriculum

    proposer_cls: Callable[[Any], Any] = DFlashProposer

    def _as_model(self, model: nn.Module) -> DFlashDraft:
        if not isinstance(model, self.model_cls):
            raise TypeError(f"model: got {type(model).__name__}, expected {self.model_cls.__name__} "
                            "(unwrap DDP/compile first)")
        return model

    def resolve(self, cfg: DFlashConfig, target_spec: TargetSpec) -> DFlashConfig:
        return cfg.resolve(target_spec)

    def config_of(self, model: nn.Module) -> DFlashConfig:
        return self._as_model(model).cfg

    def with_settings(self, model: nn.Module, **settings: Any) -> DFlashDraft:
        m = self._as_model(model)
        other = sorted(set(settings) - set(self.mutable_settings))
        if other:
            raise ValueError(f"settings: {other} cannot change a loaded {self.label} drafter (its architecture comes "
                             f"from the export); only {list(self.mutable_settings)} can")
        m.cfg = replace(m.cfg, **settings)
        return m

    def set_target_head(self, model: nn.Module, embed_tokens: Tensor, lm_head: Tensor) -> None:
        """embed_tokens [V, H] / lm_head [V, H] -> the frozen target buffers (block inputs, logits)."""
        m = self._as_model(model)
        m.target_embed_tokens = embed_tokens.to(m.target_embed_tokens.device, m.target_embed_tokens.dtype)
        m.target_lm_head = lm_head.to(m.target_lm_head.device, m.target_lm_head.dtype)

    def engine_format(self, cfg: DFlashConfig, target_spec: TargetSpec) -> DFlashExportConfig:
        return self.export_cls.from_drafter(cfg, target_spec)

    def format_from_dict(self, data: Mapping[str, Any]) -> DFlashExportConfig:
        return self.export_cls.from_dict(data)

    def load_export(self, export_dir: str | Path, target: TargetHead) -> DFlashDraft:
        return load_export(export_dir, target, self.export_cls, self.config_cls, self.model_cls)

    def build(self, cfg: DFlashConfig, target: TargetHead, store_stats: StoreStats | None = None) -> DFlashDraft:
        """A fresh draft (full target vocab: no draft vocab, `store_stats` is unused)."""
        return self.model_cls(cfg, target)

    def required_fields(self, cfg: DFlashConfig) -> tuple[str, ...]:
        return self.required

    def required_layout(self, cfg: DFlashConfig, target_spec: TargetSpec) -> Layout:
        """The context layers in the internal convention (output-of-layer id + 1), and the post-norm
        last hidden only for a family that reads it (DSpark's target distribution; DFlash and Domino
        do not), so a store without it (SGLang's aux rollout capture) serves them."""
        last = "post_norm" if "last_hidden" in self.required else "none"
        return Layout(layer_ids=cfg.hidden_state_ids(target_spec), last_hidden=last)

    def collate(self, samples: list[dict[str, Tensor]]) -> dict[str, Tensor]:
        missing = [f for f in self.required if samples and f not in samples[0]]
        if missing:
            raise KeyError(f"{self.label} samples: missing fields {missing} (have {sorted(samples[0])})")
        return collate(samples)

    def objective(self, model: nn.Module, batch: dict[str, Tensor], progress: float = 0.0) -> ObjectiveOutput:
        """`progress` drives a curriculum where the family has one (Domino). Anchors are drawn from
        torch's global generator: a fresh draw every step."""
        return self._objective(self._as_model(model), batch, progress)

    def export(self, model: nn.Module, cfg: DFlashConfig, target_spec: TargetSpec, out_dir: str | Path,
               fmt: str = "native", **kwargs: Any) -> Path:
        """`drafters.dflash.export.export` in this family's format (format "native"; kwargs dtype, meta)."""
        return export_model(self._as_model(model), cfg, target_spec, Path(out_dir), fmt, self.export_cls, **kwargs)

    def proposer(self, model: nn.Module, target_spec: TargetSpec) -> Any:
        m = self._as_model(model)
        if m.spec.vocab_size != target_spec.vocab_size or m.spec.hidden_size != target_spec.hidden_size:
            raise ValueError(f"proposer: model built for vocab/hidden {m.spec.vocab_size}/{m.spec.hidden_size}, "
                             f"target has {target_spec.vocab_size}/{target_spec.hidden_size}")
        return self.proposer_cls(m)


FAMILY = DFlashFamily()
_CONFORMS: DrafterFamily = FAMILY  # mypy checks the family against the catalog protocol
