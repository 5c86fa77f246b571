"""Drafter families, their shared pieces and the reference speculative decoder (imports only torch,
safetensors, numpy and `feature_store`; never initialises CUDA)."""

from drafters.registry import available_families, get_family, known_families

__all__ = ["available_families", "get_family", "known_families"]
