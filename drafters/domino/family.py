"""The Domino family object registered in the catalog: `DFlashFamily`'s methods (one backbone)
over Domino's config, model, export, objective (with the curriculum) and proposer."""

from __future__ import annotations

from typing import Any

from torch import Tensor

from drafters.common.contract import DrafterFamily
from drafters.common.losses import ObjectiveOutput
from drafters.dflash.family import DFlashFamily
from drafters.domino.config import DominoConfig
from drafters.domino.export import DominoExportConfig
from drafters.domino.model import DominoDraft
from drafters.domino.objective import REQUIRED_FIELDS, domino_objective
from drafters.domino.proposer import DominoProposer


class DominoFamily(DFlashFamily):
    name = "domino"
    label = "Domino"
    config_cls = DominoConfig
    model_cls = DominoDraft
    export_cls = DominoExportConfig
    required = REQUIRED_FIELDS
    mutable_settings = ("loss_gamma", "num_anchors", "attn_backend", "lambda_start", "lambda_decay_fraction",
                        "loss_chunk_rows")
    proposer_cls = DominoProposer

    @staticmethod
    def _objective(model: Any, batch: dict[str, Tensor], progress: float) -> ObjectiveOutput:
        return domino_objective(model, batch, progress)  # progress drives the base-anchored curriculum


FAMILY = DominoFamily()
_CONFORMS: DrafterFamily = FAMILY  # mypy checks the family against the catalog protocol
