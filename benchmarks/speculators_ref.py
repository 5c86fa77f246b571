"""speculators, the training-step benchmark's reference (scripts/bench_train_step.py), kept off sys.path.

scripts/setup_env.sh installs speculators 0.9.0 with `--no-deps --target <venv>/speculators_ref`: its wheel
declares torchaudio and torchvision, which it does not import here and which have no build beside this CPU
torch, so in site-packages it would leave pip's resolver inconsistent. Its other requirements are installed in
the venv (scripts/pip_check.py checks them). `use_speculators` appends the tree to sys.path before the
benchmark builds speculators' side.
"""

from __future__ import annotations

import importlib.metadata
import sys
from pathlib import Path

NAME, VERSION = "speculators", "0.9.0"
REF = Path(sys.prefix) / "speculators_ref"


def use_speculators(ref: Path = REF) -> None:
    """Make `import speculators` load speculators VERSION from `ref`; the error names the install command."""
    found = [d.version for d in importlib.metadata.distributions(name=NAME, path=[str(ref)])]
    if found != [VERSION]:
        raise ModuleNotFoundError(f"{ref}: {NAME} {', '.join(found) or 'missing'}, expected {VERSION}; "
                                  f"scripts/setup_env.sh installs it (pip install --no-deps --target {ref} "
                                  f"{NAME}=={VERSION})", name=NAME)
    if str(ref) not in sys.path:
        sys.path.append(str(ref))
