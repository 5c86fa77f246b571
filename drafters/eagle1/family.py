"""The EAGLE-1 family object registered in the catalog (docs/internals.md contract)."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import fields, replace
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from drafters.common.collate import collate
from drafters.common.contract import DrafterFamily, StoreStats
from drafters.common.losses import ObjectiveOutput
from drafters.common.target import TargetHead, TargetSpec
from drafters.eagle1.config import Eagle1Config
from drafters.eagle1.export import Eagle1ExportConfig
from drafters.eagle1.model import Eagle1Model
from drafters.eagle1.objective import REQUIRED_FIELDS, eagle1_objective
from drafters.eagle1.proposer import Eagle1Proposer
from feature_store import Layout

EXPORT_MODULE = "drafters.eagle1.export"


def _as_model(model: nn.Module) -> Eagle1Model:
    if not isinstance(model, Eagle1Model):
        raise TypeError(f"model: got {type(model).__name__}, expected Eagle1Model (unwrap DDP/compile first)")
    return model


class Eagle1Family:
    name = "eagle1"
    config_cls = Eagle1Config
    # every setting is a training choice: none changes the exported function
    mutable_settings = tuple(f.name for f in fields(Eagle1Config))

    def resolve(self, cfg: Eagle1Config, target_spec: TargetSpec) -> Eagle1Config:
        return cfg.resolve(target_spec)

    def config_of(self, model: nn.Module) -> Eagle1Config:
        return _as_model(model).cfg

    def with_settings(self, model: nn.Module, **settings: Any) -> Eagle1Model:
        m = _as_model(model)
        other = sorted(set(settings) - set(self.mutable_settings))
        if other:
            raise ValueError(f"settings {other} are not EAGLE-1 settings; expected some of {list(self.mutable_settings)}")
        m.cfg = replace(m.cfg, **settings)
        return m

    def set_target_head(self, model: nn.Module, embed_tokens: Tensor, lm_head: Tensor) -> None:
        """embed_tokens [V, H] -> the frozen embedding; lm_head [V, H] -> the frozen head (targets and drafts)."""
        m = _as_model(model)
        m.target_lm_head = lm_head.to(m.target_lm_head.device, m.target_lm_head.dtype)
        with torch.no_grad():
            m.embed_tokens.weight.copy_(embed_tokens.to(m.embed_tokens.weight.device, m.embed_tokens.weight.dtype))

    def engine_format(self, cfg: Eagle1Config, target_spec: TargetSpec) -> Eagle1ExportConfig:
        return Eagle1ExportConfig.from_drafter(cfg, target_spec)

    def format_from_dict(self, data: Mapping[str, Any]) -> Eagle1ExportConfig:
        return Eagle1ExportConfig.from_dict(data)

    def load_export(self, export_dir: str | Path, target: TargetHead) -> Eagle1Model:
        """The trainable model of an export of `target` (checked by `check_export`), in eval mode."""
        module = importlib.import_module(EXPORT_MODULE)
        model: Eagle1Model = module.load_export(export_dir, target)
        return model.eval()

    def build(self, cfg: Eagle1Config, target: TargetHead, store_stats: StoreStats | None = None) -> Eagle1Model:
        """A fresh draft model over the target's frozen embedding and LM head (no store stats needed)."""
        return Eagle1Model(cfg.resolve(target.spec), target)

    def required_fields(self, cfg: Eagle1Config) -> tuple[str, ...]:
        return REQUIRED_FIELDS

    def required_layout(self, cfg: Eagle1Config, target_spec: TargetSpec) -> Layout:
        """No aux layers: only the post-final-norm last hidden state (the EAGLE-1 feature)."""
        cfg.resolve(target_spec)
        return Layout(layer_ids=(), last_hidden="post_norm")

    def collate(self, samples: list[dict[str, Tensor]]) -> dict[str, Tensor]:
        missing = [f for f in REQUIRED_FIELDS if samples and f not in samples[0]]
        if missing:
            raise KeyError(f"EAGLE-1 samples: missing fields {missing} (have {sorted(samples[0])})")
        return collate(samples)

    def objective(self, model: nn.Module, batch: dict[str, Tensor], progress: float = 0.0) -> ObjectiveOutput:
        """No curriculum. Feature noise (training mode) comes from torch's global RNG (the trainer seeds it)."""
        return eagle1_objective(_as_model(model), batch)

    def export(self, model: nn.Module, cfg: Eagle1Config, target_spec: TargetSpec, out_dir: str | Path,
               fmt: str = "native", **kwargs: Any) -> Path:
        """Delegates to `drafters.eagle1.export.export` (format "native"; kwargs dtype, meta)."""
        module = importlib.import_module(EXPORT_MODULE)
        out: Path = module.export(_as_model(model), cfg, target_spec, Path(out_dir), fmt, **kwargs)
        return out

    def proposer(self, model: nn.Module, target_spec: TargetSpec) -> Eagle1Proposer:
        m = _as_model(model)
        if m.spec.vocab_size != target_spec.vocab_size or m.spec.hidden_size != target_spec.hidden_size:
            raise ValueError(f"proposer: model built for vocab/hidden {m.spec.vocab_size}/{m.spec.hidden_size}, "
                             f"target has {target_spec.vocab_size}/{target_spec.hidden_size}")
        return Eagle1Proposer(m)


FAMILY = Eagle1Family()
_CONFORMS: DrafterFamily = FAMILY  # mypy checks the family against the catalog protocol
