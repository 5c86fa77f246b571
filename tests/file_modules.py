"""Load a Python file that is not on the import path as a module: the repository's scripts
(`scripts/*.py`, applications the libraries never import) and the SGLang source the engine
tests read (`engines/sglang_ref.py`). `tests/` is on pytest's `pythonpath` (pyproject.toml)."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]


def load_file_module(name: str, path: Path) -> ModuleType:
    """Execute `path` as module `name`, registered in `sys.modules` (dataclasses and typing resolve
    a module's annotations through it)."""
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"{path}: not loadable as a Python module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return module


def load_script(stem: str) -> ModuleType:
    """`scripts/<stem>.py` as module `<stem>`."""
    return load_file_module(stem, ROOT / "scripts" / f"{stem}.py")
