"""SGLang 0.5.23's own source, for the few modules that run without a GPU.

`scripts/setup_env.sh` installs the sglang wheel WITHOUT its dependencies into `.venv/sglang_ref`
(not on sys.path: `import sglang` needs its CUDA stack and IPython, and verl probes for sglang). A
module whose imports are torch-only (e.g. `srt/speculative/domino_utils.py`, SGLang's Domino
rollout) is loaded here from its file, unchanged, under a private name.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import ModuleType

from file_modules import load_file_module

ROOT = Path(sys.prefix) / "sglang_ref" / "sglang"
VERSION = "0.5.23"


def load_module(relpath: str) -> ModuleType:
    """`relpath` under the sglang package, e.g. "srt/speculative/domino_utils.py"."""
    path = ROOT / relpath
    if not path.is_file():
        raise FileNotFoundError(f"{path}: missing; SGLang {VERSION}'s source is installed by scripts/setup_env.sh "
                                f"(pip install --no-deps --target {ROOT.parent} sglang=={VERSION})")
    version_file = ROOT / "_version.py"
    if version_file.is_file() and VERSION not in version_file.read_text():
        raise RuntimeError(f"{version_file}: expected SGLang {VERSION}")
    name = "_sglang_ref_" + relpath.removesuffix(".py").replace("/", "_")
    return load_file_module(name, path)
