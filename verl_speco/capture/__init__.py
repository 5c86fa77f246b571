"""Feature capture from HF targets: forward hooks (``capture_features``), Feature Store records and
the ``verl-speco-collect`` CLI (``collect_features``). Layer ids use the internal convention
(HF ``hidden_states`` indexing, docs/internals.md)."""

from verl_speco.capture.hooks import CapturedFeatures, FeatureCapture, capture_features, find_decoder_modules

__all__ = ["CapturedFeatures", "FeatureCapture", "capture_features", "collect_features", "find_decoder_modules"]


def __getattr__(name: str) -> object:
    # collect pulls in feature_store and the dataset code; keep `import verl_speco.capture` light.
    if name == "collect_features":
        from verl_speco.capture.collect import collect_features

        return collect_features
    raise AttributeError(f"module 'verl_speco.capture' has no attribute {name!r}")
