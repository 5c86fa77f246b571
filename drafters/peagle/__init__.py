"""P-EAGLE drafter family (docs/design/algorithms.md section 7). The family object is `FAMILY`."""

from drafters.peagle.config import PEagleConfig
from drafters.peagle.family import FAMILY, PEagleFamily
from drafters.peagle.model import PEagleModel

__all__ = ["FAMILY", "PEagleConfig", "PEagleFamily", "PEagleModel"]
