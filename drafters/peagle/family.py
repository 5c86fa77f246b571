"""The P-EAGLE family object registered in the catalog: EAGLE-3's family with P-EAGLE's config, model,
objective, export and proposer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from drafters.common.contract import DrafterFamily
from drafters.common.losses import ObjectiveOutput
from drafters.common.target import TargetHead, TargetSpec
from drafters.eagle3.family import Eagle3Family
from drafters.peagle.config import PEagleConfig
from drafters.peagle.export import PEagleExportConfig, load_export
from drafters.peagle.model import PEagleModel
from drafters.peagle.objective import peagle_objective
from drafters.peagle.proposer import PEagleProposer


class PEagleFamily(Eagle3Family):
    name = "peagle"
    label = "P-EAGLE"
    config_cls = PEagleConfig
    model_cls = PEagleModel
    export_cls = PEagleExportConfig
    proposer_cls = PEagleProposer
    export_module = "drafters.peagle.export"
    # training-only choices: the COD budget and the partitioning change no exported function
    mutable_settings = ("cod_ratio", "cod_ratio_min", "num_segments", "attn_backend", "loss_chunk_rows")

    def engine_format(self, cfg: Any, target_spec: TargetSpec) -> PEagleExportConfig:
        return PEagleExportConfig.from_peagle(self._as_config(cfg), target_spec)

    def load_export(self, export_dir: str | Path, target: TargetHead) -> PEagleModel:
        """The trainable model of a checked export (`drafters.peagle.export.check_export`), eval mode."""
        state, export_cfg = load_export(export_dir)
        if export_cfg.target_num_hidden_layers != target.spec.num_hidden_layers:
            raise ValueError(f"{export_dir}: exported for a {export_cfg.target_num_hidden_layers}-layer target, "
                             f"this target has {target.spec.num_hidden_layers}")
        cfg = PEagleConfig(draft_vocab_size=export_cfg.draft_vocab_size, num_layers=export_cfg.num_layers,
                           aux_layer_ids=tuple(export_cfg.aux_layer_ids),
                           norm_before_residual=export_cfg.norm_before_residual,
                           num_depths=export_cfg.num_depths, mask_token_id=export_cfg.mask_token_id)
        model: PEagleModel = self._loaded(cfg, target, state, export_dir)
        return model

    def objective(self, model: nn.Module, batch: dict[str, Any], progress: float = 0.0) -> ObjectiveOutput:
        """No curriculum; COD draws come from torch's global generator (a fresh sample every step)."""
        return peagle_objective(self._as_model(model), batch)


FAMILY = PEagleFamily()
_CONFORMS: DrafterFamily = FAMILY  # mypy checks the family against the catalog protocol
