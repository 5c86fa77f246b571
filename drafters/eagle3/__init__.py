"""EAGLE-3 drafter family (docs/design/algorithms.md section 3). The family object is `FAMILY`."""

from drafters.eagle3.config import Eagle3Config
from drafters.eagle3.family import FAMILY, Eagle3Family
from drafters.eagle3.model import Eagle3DraftState, Eagle3Model

__all__ = ["FAMILY", "Eagle3Config", "Eagle3DraftState", "Eagle3Family", "Eagle3Model"]
