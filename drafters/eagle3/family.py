"""The EAGLE-3 family object registered in the catalog (docs/internals.md contract)."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from drafters.common.contract import DrafterFamily, StoreStats
from drafters.common.family_base import DrafterFamilyBase
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


class Eagle3Family(DrafterFamilyBase):
    """EAGLE-3; P-EAGLE (drafters/peagle/family.py) subclasses it with its own config, model,
    objective, export and proposer."""

    name = "eagle3"
    label = "EAGLE-3"
    config_cls: type[Eagle3Architecture] = Eagle3Config
    model_cls: type[Eagle3Backbone[Any]] = Eagle3Model
    required = REQUIRED_FIELDS
    export_cls: type[Any] = Eagle3ExportConfig
    proposer_cls: type[Any] = Eagle3Proposer
    export_module = EXPORT_MODULE
    # may change on a drafter loaded from an export: they shape training, not the exported function
    mutable_settings: tuple[str, ...] = ("ttt_steps", "ttt_decay", "attn_backend", "loss_chunk_rows")

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

    def required_layout(self, cfg: Eagle3Architecture, target_spec: TargetSpec) -> Layout:
        """The resolved aux layer ids (internal convention) plus the post-final-norm last hidden."""
        aux = Eagle3Architecture.resolve(cfg, target_spec).aux_layer_ids  # the architecture's part only
        assert aux is not None
        return Layout(layer_ids=aux, last_hidden="post_norm")

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


FAMILY = Eagle3Family()
_CONFORMS: DrafterFamily = FAMILY  # mypy checks the family against the catalog protocol
