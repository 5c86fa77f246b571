"""EAGLE-2 drafter family (docs/design/algorithms.md section 2, docs/design/engines.md sections 2.2 and 4.1): EAGLE-1 weights, dynamic-tree
drafting. The family object is `FAMILY`."""

from drafters.eagle2.config import Eagle2Config
from drafters.eagle2.export import Eagle2ExportConfig
from drafters.eagle2.family import FAMILY, Eagle2Family

__all__ = ["FAMILY", "Eagle2Config", "Eagle2ExportConfig", "Eagle2Family"]
