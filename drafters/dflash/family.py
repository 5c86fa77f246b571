"""The DFlash family object registered in the catalog (docs/internals.md contract), written over its class
attributes so families on the same backbone (DSpark, Domino) subclass it and name their own pieces."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import Tensor, nn

from drafters.common.contract import DrafterFamily
from drafters.common.family_base import DrafterFamilyBase
from drafters.common.losses import ObjectiveOutput
from drafters.common.target import TargetHead, TargetSpec
from drafters.dflash.config import DFlashConfig
from drafters.dflash.export import DFlashExportConfig, load_export
from drafters.dflash.export import export as export_model
from drafters.dflash.model import DFlashDraft
from drafters.dflash.objective import REQUIRED_FIELDS, dflash_objective
from drafters.dflash.proposer import DFlashProposer
from feature_store import Layout


class DFlashFamily(DrafterFamilyBase):
    name = "dflash"
    label = "DFlash"  # in messages
    config_cls: type[DFlashConfig] = DFlashConfig
    model_cls: type[DFlashDraft] = DFlashDraft
    export_cls: type[DFlashExportConfig] = DFlashExportConfig
    required: tuple[str, ...] = REQUIRED_FIELDS
    proposer_cls: type[Any] = DFlashProposer
    # training-only choices: they shape the objective or the kernel, not the exported function
    mutable_settings: tuple[str, ...] = ("loss_gamma", "num_anchors", "attn_backend", "loss_chunk_rows")
    # set_target_head: embed_tokens [V, H] / lm_head [V, H] -> the frozen target buffers (block inputs, logits)
    target_embed = "target_embed_tokens"
    target_lm_head = "target_lm_head"

    @staticmethod
    def _objective(model: Any, batch: dict[str, Tensor], progress: float) -> ObjectiveOutput:
        return dflash_objective(model, batch)  # no curriculum

    def load_export(self, export_dir: str | Path, target: TargetHead) -> DFlashDraft:
        return load_export(export_dir, target, self.export_cls, self.config_cls, self.model_cls)

    def required_layout(self, cfg: DFlashConfig, target_spec: TargetSpec) -> Layout:
        """The context layers (internal ids) and the post-norm last hidden only for a family that reads it
        (DSpark), so a store without it (SGLang's aux rollout capture) serves DFlash and Domino."""
        last = "post_norm" if "last_hidden" in self.required else "none"
        return Layout(layer_ids=cfg.hidden_state_ids(target_spec), last_hidden=last)

    def objective(self, model: nn.Module, batch: dict[str, Tensor], progress: float = 0.0) -> ObjectiveOutput:
        """`progress` drives a curriculum where the family has one (Domino). Anchors are drawn from
        torch's global generator: a fresh draw every step."""
        return self._objective(self._as_model(model), batch, progress)

    def export(self, model: nn.Module, cfg: DFlashConfig, target_spec: TargetSpec, out_dir: str | Path,
               fmt: str = "native", **kwargs: Any) -> Path:
        """`drafters.dflash.export.export` in this family's format (format "native"; kwargs dtype, meta)."""
        return export_model(self._as_model(model), cfg, target_spec, Path(out_dir), fmt, self.export_cls, **kwargs)


FAMILY = DFlashFamily()
_CONFORMS: DrafterFamily = FAMILY  # mypy checks the family against the catalog protocol
