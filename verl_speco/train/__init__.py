"""Standalone drafter trainer: typed config schema, Hydra composition of `configs/`, the torchrun
launcher `verl-speco-draft-train`, the FSDP2 training loop, checkpoints and exact resume."""
