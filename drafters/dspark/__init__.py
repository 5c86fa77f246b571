"""DSpark drafter (docs/design/algorithms.md section 5): the DFlash backbone with the "anchor predicts the
first token" layout, a Markov head and a confidence head; the catalog's family object is `FAMILY`."""

from drafters.dspark.config import DSparkConfig
from drafters.dspark.family import FAMILY
from drafters.dspark.model import DSparkDraft

__all__ = ["FAMILY", "DSparkConfig", "DSparkDraft"]
