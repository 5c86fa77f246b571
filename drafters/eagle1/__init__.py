"""EAGLE-1 drafter family (docs/design/algorithms.md section 1, docs/design/engines.md sections 2.1 and 4.2). The family object is `FAMILY`."""

from drafters.eagle1.config import Eagle1Config
from drafters.eagle1.family import FAMILY, Eagle1Family
from drafters.eagle1.model import Eagle1DraftState, Eagle1Model

__all__ = ["FAMILY", "Eagle1Config", "Eagle1DraftState", "Eagle1Family", "Eagle1Model"]
