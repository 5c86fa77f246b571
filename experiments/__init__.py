"""Studies run on top of the library: the drift study (`python -m experiments.drift`, from the
repository root) and its statistics. Not installed with the package; nothing under verl_speco/,
drafters/ or feature_store/ imports it (tests/test_import_boundaries.py)."""
