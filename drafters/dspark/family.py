"""The DSpark family object registered in the catalog: `DFlashFamily`'s methods (one backbone)
over DSpark's config, model, export, objective and proposer."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from drafters.common.contract import DrafterFamily
from drafters.common.losses import ObjectiveOutput
from drafters.dflash.family import DFlashFamily
from drafters.dspark.config import DSparkConfig
from drafters.dspark.export import DSparkExportConfig
from drafters.dspark.model import DSparkDraft
from drafters.dspark.objective import REQUIRED_FIELDS, dspark_objective
from drafters.dspark.proposer import DSparkProposer


class DSparkFamily(DFlashFamily):
    name = "dspark"
    label = "DSpark"
    config_cls = DSparkConfig
    model_cls = DSparkDraft
    export_cls = DSparkExportConfig
    required = REQUIRED_FIELDS
    mutable_settings = ("loss_gamma", "num_anchors", "attn_backend", "ce_weight", "l1_weight", "conf_weight",
                        "ce_mode", "ce_vocab", "loss_chunk_rows")
    proposer_cls = DSparkProposer

    @staticmethod
    def _objective(model: Any, batch: dict[str, Tensor], progress: float) -> ObjectiveOutput:
        return dspark_objective(model, batch)  # no curriculum


FAMILY = DSparkFamily()
_CONFORMS: DrafterFamily = FAMILY  # mypy checks the family against the catalog protocol
