"""The verl side of online drafter co-training: with `verl_speco.cpu_port.verl_platform`, the only place
in verl_speco that imports verl/ray (lazily where it can, so `import verl_speco` never loads verl).
Entry point: `task_runner.run`; `trainer` adapts verl's hooks to `verl_speco.online.controller`."""
