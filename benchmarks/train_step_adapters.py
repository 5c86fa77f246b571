"""Per-family adapters for scripts/bench_train_step.py: our drafter and speculators' at equal shapes.

An adapter builds, for one drafter family, both sides at the same sizes with IDENTICAL weights (ours
copied into speculators' by parameter name), one synthetic batch in each side's layout, the
forward + loss closure of each side, and a loss check that feeds both sides the same rows. The
script owns everything else (timing, interleaving, peak memory, report). The adapters live one module per
family (`train_step_eagle3`, `train_step_dflash` with DSpark, `train_step_peagle`); a new family is one
more module and one more entry in `ADAPTERS`.

Speculators is a benchmark-only reference (docs/design/environment.md section 1): built from config
objects, verifier name None (nothing downloaded), verifier embed / lm_head / norm loaded from our
synthetic target, `sdpa` attention and the "eager" losses (its defaults, flex attention and the
fused Triton losses, need CUDA; flex attention's backward does not run on CPU).

Each adapter's docstring lists the semantic differences between the two sides; the loss check
prints how they show in the numbers.
"""

from __future__ import annotations

from benchmarks.train_step_common import Adapter
from benchmarks.train_step_dflash import DFlashAdapter, DSparkAdapter
from benchmarks.train_step_eagle3 import Eagle3Adapter
from benchmarks.train_step_peagle import PEagleAdapter

ADAPTERS: dict[str, Adapter] = {a.name: a for a in (Eagle3Adapter(), DFlashAdapter(), DSparkAdapter(),
                                                     PEagleAdapter())}
