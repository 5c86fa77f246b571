"""The EAGLE-2 family object registered in the catalog (docs/internals.md contract): EAGLE-1's weights,
model and objective, plus the tree (`Eagle2Config`, `tree_config` / `tree_proposer`, an engine format
that records the tree SGLang drafts); `proposer` stays the EAGLE-1 chain vLLM serves."""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path
from typing import Any

from torch import nn

from drafters.common.contract import EXPORT_META_FILE
from drafters.common.target import TargetHead, TargetSpec
from drafters.common.tree import TreeConfig, TreeDrafterFamily
from drafters.eagle1.config import Eagle1Config
from drafters.eagle1.family import Eagle1Family
from drafters.eagle1.model import Eagle1Model
from drafters.eagle1.proposer import Eagle1Proposer
from drafters.eagle2 import export as export_module
from drafters.eagle2.config import TREE_FIELDS, Eagle2Config
from drafters.eagle2.export import Eagle2ExportConfig


def _recorded_tree(export_dir: Path) -> dict[str, Any]:
    """The tree shape recorded in an export's meta (`engine_format`); {} for an EAGLE-1 export."""
    meta = export_dir / EXPORT_META_FILE
    fmt = json.loads(meta.read_text()).get("engine_format", {}) if meta.is_file() else {}
    return {k: fmt[k] for k in TREE_FIELDS if k in fmt}


class Eagle2Family(Eagle1Family):
    name = "eagle2"
    label = "EAGLE-2"
    config_cls = Eagle2Config  # the EAGLE-1 settings plus the tree; the model is EAGLE-1's
    export_cls = Eagle2ExportConfig
    # training choices and the tree shape: none changes the exported function
    mutable_settings = tuple(f.name for f in fields(Eagle2Config))

    def load_export(self, export_dir: str | Path, target: TargetHead) -> Eagle1Model:
        """The EAGLE-1 reader (checks and exact weights), then the tree recorded in the export
        (EAGLE-1 exports load too, with the default tree); eval mode."""
        model = super().load_export(export_dir, target)
        model.cfg = Eagle2Config(**{f.name: getattr(model.cfg, f.name) for f in fields(model.cfg)},
                                 **_recorded_tree(Path(export_dir)))
        return model

    def export(self, model: nn.Module, cfg: Eagle1Config, target_spec: TargetSpec, out_dir: str | Path,
               fmt: str = "native", **kwargs: Any) -> Path:
        """`drafters.eagle2.export.export` (format "native", the EAGLE-1 directory; kwargs dtype, meta)."""
        return export_module.export(self._as_model(model), self._as_config(cfg), target_spec, Path(out_dir), fmt,
                                    **kwargs)

    def tree_config(self, cfg: Eagle1Config) -> TreeConfig:
        tree: TreeConfig = self._as_config(cfg).tree()
        return tree

    def tree_proposer(self, model: nn.Module, target_spec: TargetSpec) -> Eagle1Proposer:
        """The EAGLE-1 proposer: its `expand` drafts the tree (drafters/eagle1/proposer.py)."""
        proposer: Eagle1Proposer = self.proposer(model, target_spec)
        return proposer


FAMILY = Eagle2Family()
_CONFORMS: TreeDrafterFamily = FAMILY  # mypy checks the family against the catalog protocol
