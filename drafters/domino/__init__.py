"""Domino drafter (docs/design/algorithms.md section 6): the DFlash backbone with shifted labels and a causal
GRU correction head; the catalog's family object is `FAMILY`."""

from drafters.domino.config import DominoConfig
from drafters.domino.family import FAMILY
from drafters.domino.model import DominoDraft

__all__ = ["FAMILY", "DominoConfig", "DominoDraft"]
