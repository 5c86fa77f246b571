"""Benchmark helpers used by scripts/bench_*.py (not installed with the package; the scripts put the
repository root on sys.path)."""
