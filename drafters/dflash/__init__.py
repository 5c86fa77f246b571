"""DFlash block-diffusion drafter (docs/design/algorithms.md section 4): config, backbone, objective, export,
block proposer and the catalog's family object."""

from drafters.dflash.config import DFlashConfig
from drafters.dflash.family import FAMILY
from drafters.dflash.model import DFlashDraft

__all__ = ["FAMILY", "DFlashConfig", "DFlashDraft"]
