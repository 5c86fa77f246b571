"""The EAGLE-1 family object registered in the catalog (docs/internals.md contract); EAGLE-2
(drafters/eagle2/family.py) subclasses it with its own config and export."""

from __future__ import annotations

import importlib
from dataclasses import fields
from pathlib import Path
from typing import Any

from torch import Tensor, nn

from drafters.common.contract import DrafterFamily
from drafters.common.family_base import DrafterFamilyBase
from drafters.common.losses import ObjectiveOutput
from drafters.common.target import TargetHead, TargetSpec
from drafters.eagle1.config import Eagle1Config
from drafters.eagle1.export import Eagle1ExportConfig
from drafters.eagle1.model import Eagle1Model
from drafters.eagle1.objective import REQUIRED_FIELDS, eagle1_objective
from drafters.eagle1.proposer import Eagle1Proposer
from feature_store import Layout

EXPORT_MODULE = "drafters.eagle1.export"


class Eagle1Family(DrafterFamilyBase):
    name = "eagle1"
    label = "EAGLE-1"
    config_cls: type[Eagle1Config] = Eagle1Config
    model_cls = Eagle1Model
    required = REQUIRED_FIELDS
    export_cls: type[Eagle1ExportConfig] = Eagle1ExportConfig
    proposer_cls = Eagle1Proposer
    # every setting is a training choice: none changes the exported function
    mutable_settings = tuple(f.name for f in fields(Eagle1Config))
    # set_target_head: embed_tokens [V, H] -> the frozen embedding; lm_head [V, H] -> the frozen head
    # (targets and drafts): the defaults "embed_tokens.weight" and "target_lm_head"

    def load_export(self, export_dir: str | Path, target: TargetHead) -> Eagle1Model:
        """The trainable model of an export of `target` (checked by `check_export`), in eval mode."""
        module = importlib.import_module(EXPORT_MODULE)
        model: Eagle1Model = module.load_export(export_dir, target)
        return model.eval()

    def required_layout(self, cfg: Eagle1Config, target_spec: TargetSpec) -> Layout:
        """No aux layers: only the post-final-norm last hidden state (the EAGLE-1 feature)."""
        cfg.resolve(target_spec)
        return Layout(layer_ids=(), last_hidden="post_norm")

    def objective(self, model: nn.Module, batch: dict[str, Tensor], progress: float = 0.0) -> ObjectiveOutput:
        """No curriculum. Feature noise (training mode) comes from torch's global RNG (the trainer seeds it)."""
        return eagle1_objective(self._as_model(model), batch)

    def export(self, model: nn.Module, cfg: Eagle1Config, target_spec: TargetSpec, out_dir: str | Path,
               fmt: str = "native", **kwargs: Any) -> Path:
        """Delegates to `drafters.eagle1.export.export` (format "native"; kwargs dtype, meta)."""
        module = importlib.import_module(EXPORT_MODULE)
        out: Path = module.export(self._as_model(model), cfg, target_spec, Path(out_dir), fmt, **kwargs)
        return out


FAMILY = Eagle1Family()
_CONFORMS: DrafterFamily = FAMILY  # mypy checks the family against the catalog protocol
