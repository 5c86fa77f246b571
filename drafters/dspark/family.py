"""The DSpark family object registered in the catalog (docs/internals.md contract)."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from torch import Tensor, nn

from drafters.common.collate import collate
from drafters.common.contract import DrafterFamily, StoreStats
from drafters.common.losses import ObjectiveOutput
from drafters.common.target import TargetHead, TargetSpec
from drafters.dspark.config import DSparkConfig
from drafters.dspark.export import DSparkExportConfig, load_dspark_export
from drafters.dspark.model import DSparkDraft
from drafters.dspark.objective import REQUIRED_FIELDS, dspark_objective
from drafters.dspark.proposer import DSparkProposer
from feature_store import Layout

EXPORT_MODULE = "drafters.dspark.export"


def _as_model(model: nn.Module) -> DSparkDraft:
    if not isinstance(model, DSparkDraft):
        raise TypeError(f"model: got {type(model).__name__}, expected DSparkDraft (unwrap DDP/compile first)")
    return model


class DSparkFamily:
    name = "dspark"
    config_cls = DSparkConfig
    # training-only choices: they shape the objective or the kernel, not the exported function
    mutable_settings = ("loss_gamma", "num_anchors", "attn_backend", "ce_weight", "l1_weight", "conf_weight",
                        "ce_mode", "ce_vocab")

    def resolve(self, cfg: DSparkConfig, target_spec: TargetSpec) -> DSparkConfig:
        return cfg.resolve(target_spec)

    def config_of(self, model: nn.Module) -> DSparkConfig:
        return _as_model(model).cfg

    def with_settings(self, model: nn.Module, **settings: Any) -> DSparkDraft:
        m = _as_model(model)
        other = sorted(set(settings) - set(self.mutable_settings))
        if other:
            raise ValueError(f"settings: {other} cannot change a loaded DSpark drafter (its architecture comes "
                             f"from the export); only {list(self.mutable_settings)} can")
        m.cfg = replace(m.cfg, **settings)
        return m

    def set_target_head(self, model: nn.Module, embed_tokens: Tensor, lm_head: Tensor) -> None:
        """embed_tokens [V, H] / lm_head [V, H] -> the frozen target buffers (block inputs, logits)."""
        m = _as_model(model)
        m.target_embed_tokens = embed_tokens.to(m.target_embed_tokens.device, m.target_embed_tokens.dtype)
        m.target_lm_head = lm_head.to(m.target_lm_head.device, m.target_lm_head.dtype)

    def engine_format(self, cfg: DSparkConfig, target_spec: TargetSpec) -> DSparkExportConfig:
        return DSparkExportConfig.from_drafter(cfg, target_spec)

    def format_from_dict(self, data: Mapping[str, Any]) -> DSparkExportConfig:
        return DSparkExportConfig.from_dict(data)

    def load_export(self, export_dir: str | Path, target: TargetHead) -> DSparkDraft:
        return load_dspark_export(export_dir, target)

    def build(self, cfg: DSparkConfig, target: TargetHead, store_stats: StoreStats | None = None) -> DSparkDraft:
        """A fresh draft (full target vocab: no draft vocab, `store_stats` is unused)."""
        return DSparkDraft(cfg, target)

    def required_fields(self, cfg: DSparkConfig) -> tuple[str, ...]:
        return REQUIRED_FIELDS

    def required_layout(self, cfg: DSparkConfig, target_spec: TargetSpec) -> Layout:
        """The context layers in the internal convention (output-of-layer id + 1) and the post-norm
        last hidden (the target distribution of the L1 and confidence terms)."""
        return Layout(layer_ids=cfg.hidden_state_ids(target_spec), last_hidden="post_norm")

    def collate(self, samples: list[dict[str, Tensor]]) -> dict[str, Tensor]:
        missing = [f for f in REQUIRED_FIELDS if samples and f not in samples[0]]
        if missing:
            raise KeyError(f"DSpark samples: missing fields {missing} (have {sorted(samples[0])})")
        return collate(samples)

    def objective(self, model: nn.Module, batch: dict[str, Tensor], progress: float = 0.0) -> ObjectiveOutput:
        """No curriculum. Anchors are drawn from torch's global generator: a fresh draw every step."""
        return dspark_objective(_as_model(model), batch)

    def export(self, model: nn.Module, cfg: DSparkConfig, target_spec: TargetSpec, out_dir: str | Path,
               fmt: str = "native", **kwargs: Any) -> Path:
        """Delegates to `drafters.dspark.export.export` (format "native"; kwargs dtype, meta)."""
        module = importlib.import_module(EXPORT_MODULE)
        out: Path = module.export(_as_model(model), cfg, target_spec, Path(out_dir), fmt, **kwargs)
        return out

    def proposer(self, model: nn.Module, target_spec: TargetSpec) -> DSparkProposer:
        m = _as_model(model)
        if m.spec.vocab_size != target_spec.vocab_size or m.spec.hidden_size != target_spec.hidden_size:
            raise ValueError(f"proposer: model built for vocab/hidden {m.spec.vocab_size}/{m.spec.hidden_size}, "
                             f"target has {target_spec.vocab_size}/{target_spec.hidden_size}")
        return DSparkProposer(m)


FAMILY = DSparkFamily()
_CONFORMS: DrafterFamily = FAMILY  # mypy checks the family against the catalog protocol
