"""The EAGLE-3 family object registered in the catalog (docs/internals.md contract)."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from drafters.common.collate import collate
from drafters.common.contract import DrafterFamily, StoreStats
from drafters.common.losses import ObjectiveOutput
from drafters.common.target import TargetHead, TargetSpec
from drafters.common.vocab import DraftVocab
from drafters.eagle3.config import Eagle3Architecture, Eagle3Config
from drafters.eagle3.export import Eagle3ExportConfig, load_export
from drafters.eagle3.model import Eagle3Backbone, Eagle3Model
from drafters.eagle3.objective import REQUIRED_FIELDS, eagle3_objective
from drafters.eagle3.proposer import Eagle3Proposer
from feature_store import Layout

EXPORT_MODULE = "drafters.eagle3.export"
NOT_EXPORTED = ("embed_tokens.weight",)  # model entries an export does not carry: the target's embedding


class Eagle3Family:
    """EAGLE-3; P-EAGLE (drafters/peagle/family.py) subclasses it: same architecture, vocab
    selection, target head and layout, its own config, model, objective, export and proposer."""

    name = "eagle3"
    label = "EAGLE-3"
    config_cls: type[Eagle3Architecture] = Eagle3Config
    model_cls: type[Eagle3Backbone[Any]] = Eagle3Model
    proposer_cls: Any = Eagle3Proposer
    export_module = EXPORT_MODULE
    # may change on a drafter loaded from an export: they shape training, not the exported function
    mutable_settings: tuple[str, ...] = ("ttt_steps", "ttt_decay", "attn_backend", "loss_chunk_rows")

    def _as_model(self, model: nn.Module) -> Any:
        if not isinstance(model, self.model_cls):
            raise TypeError(f"model: got {type(model).__name__}, expected {self.model_cls.__name__} (unwrap "
                            "DDP/compile first)")
        return model

    def resolve(self, cfg: Eagle3Architecture, target_spec: TargetSpec) -> Eagle3Architecture:
        return cfg.resolve(target_spec)

    def config_of(self, model: nn.Module) -> Eagle3Architecture:
        return self._as_model(model).cfg

    def with_settings(self, model: nn.Module, **settings: Any) -> Eagle3Model:
        m = self._as_model(model)
        other = sorted(set(settings) - set(self.mutable_settings))
        if other:
            raise ValueError(f"settings: {other} cannot change a loaded {self.label} drafter (its architecture comes "
                             f"from the export); only {list(self.mutable_settings)} can")
        m.cfg = replace(m.cfg, **settings)
        return m

    def set_target_head(self, model: nn.Module, embed_tokens: Tensor, lm_head: Tensor) -> None:
        """embed_tokens [V, H] -> the frozen embedding; lm_head [V, H] -> the training-target head."""
        m = self._as_model(model)
        m.target_lm_head = lm_head.to(m.target_lm_head.device, m.target_lm_head.dtype)
        with torch.no_grad():
            m.embed_tokens.weight.copy_(embed_tokens.to(m.embed_tokens.weight.device, m.embed_tokens.weight.dtype))

    def engine_format(self, cfg: Eagle3Config, target_spec: TargetSpec) -> Eagle3ExportConfig:
        return Eagle3ExportConfig.from_drafter(cfg, target_spec)

    def format_from_dict(self, data: Mapping[str, Any]) -> Eagle3ExportConfig:
        return Eagle3ExportConfig.from_dict(data)

    def load_export(self, export_dir: str | Path, target: TargetHead) -> Any:
        """The trainable model of a native or speculators export of `target` (eval mode)."""
        state, export_cfg = load_export(export_dir, target.spec.num_hidden_layers)
        cfg = Eagle3Config(draft_vocab_size=export_cfg.draft_vocab_size, num_layers=export_cfg.num_layers,
                           aux_layer_ids=tuple(export_cfg.aux_layer_ids),
                           norm_before_residual=export_cfg.norm_before_residual)
        return self._loaded(cfg, target, state, export_dir)

    def _loaded(self, cfg: Eagle3Architecture, target: TargetHead, state: dict[str, Tensor],
                export_dir: str | Path) -> Any:
        """A model of `cfg` holding an export's training-name `state` (eval mode); the vocab map
        comes from the export (selecting by t2d only gives the model the right shapes)."""
        model = self.build(cfg, target, StoreStats(token_counts=state["t2d"].to(torch.float32)))
        missing, unexpected = model.load_state_dict(state, strict=False)
        missing = [k for k in missing if k not in NOT_EXPORTED]
        if missing or unexpected:
            raise ValueError(f"{export_dir}: export does not match the {self.label} model: missing {missing}, "
                             f"unexpected {unexpected}")
        return model.eval()

    def build(self, cfg: Eagle3Architecture, target: TargetHead, store_stats: StoreStats | None = None) -> Any:
        """A fresh draft model. A reduced draft vocab needs `store_stats.token_counts` [V]."""
        cfg = cfg.resolve(target.spec)
        assert cfg.draft_vocab_size is not None
        if cfg.draft_vocab_size == target.spec.vocab_size:
            vocab = DraftVocab.identity(target.spec.vocab_size)
        else:
            counts = None if store_stats is None else store_stats.token_counts
            if counts is None:
                raise ValueError(f"draft_vocab_size={cfg.draft_vocab_size} < vocab_size={target.spec.vocab_size} "
                                 "needs store_stats.token_counts (drafters.common.vocab.token_counts_from_samples)")
            if counts.numel() != target.spec.vocab_size:
                raise ValueError(f"store_stats.token_counts: {counts.numel()} entries, expected {target.spec.vocab_size}")
            vocab = DraftVocab.select(counts, cfg.draft_vocab_size)
        return self.model_cls(cfg, target, vocab)

    def required_fields(self, cfg: Eagle3Architecture) -> tuple[str, ...]:
        return REQUIRED_FIELDS

    def required_layout(self, cfg: Eagle3Architecture, target_spec: TargetSpec) -> Layout:
        """The resolved aux layer ids (internal convention) plus the post-final-norm last hidden."""
        aux = Eagle3Architecture.resolve(cfg, target_spec).aux_layer_ids  # the architecture's part only
        assert aux is not None
        return Layout(layer_ids=aux, last_hidden="post_norm")

    def collate(self, samples: list[dict[str, Tensor]]) -> dict[str, Tensor]:
        missing = [f for f in REQUIRED_FIELDS if samples and f not in samples[0]]
        if missing:
            raise KeyError(f"{self.label} samples: missing fields {missing} (have {sorted(samples[0])})")
        return collate(samples)

    def objective(self, model: nn.Module, batch: dict[str, Tensor], progress: float = 0.0) -> ObjectiveOutput:
        """EAGLE-3's loss does not depend on training progress (no curriculum)."""
        return eagle3_objective(self._as_model(model), batch)

    def export(self, model: nn.Module, cfg: Eagle3Config, target_spec: TargetSpec, out_dir: str | Path,
               fmt: str = "native", **kwargs: Any) -> Path:
        """Delegates to `drafters.eagle3.export.export(model, cfg, target_spec, out_dir, fmt, **kwargs)`
        (formats "native" and "speculators"; kwargs such as verifier, dtype, meta)."""
        module = importlib.import_module(self.export_module)
        out: Path = module.export(self._as_model(model), cfg, target_spec, Path(out_dir), fmt, **kwargs)
        return out

    def proposer(self, model: nn.Module, target_spec: TargetSpec) -> Any:
        m = self._as_model(model)
        if m.spec.vocab_size != target_spec.vocab_size or m.spec.hidden_size != target_spec.hidden_size:
            raise ValueError(f"proposer: model built for vocab/hidden {m.spec.vocab_size}/{m.spec.hidden_size}, "
                             f"target has {target_spec.vocab_size}/{target_spec.hidden_size}")
        return self.proposer_cls(m)


FAMILY = Eagle3Family()
_CONFORMS: DrafterFamily = FAMILY  # mypy checks the family against the catalog protocol
