"""DFlash block-diffusion drafter (algorithms.md section 4): config, backbone and objective.

The family object (registry entry, export, proposer) comes in a later increment.
"""

from drafters.dflash.config import DFlashConfig
from drafters.dflash.model import DFlashDraft

__all__ = ["DFlashConfig", "DFlashDraft"]
