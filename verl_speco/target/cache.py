"""The target cache: the recipe that names a build, and atomic, digest-checked builds.

`${VERL_SPECO_CACHE:-~/.cache/verl_speco}/targets/<name>-<hash>/` is an HF directory plus
`recipe.json` (the recipe, its hash and every other file's sha256). `build_atomically` runs a build
in a temporary sibling renamed into place under a file lock, so concurrent callers build once and
never see a partial directory; every cache hit re-hashes the files (`BuildDigestError`)."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from verl_speco.target.corpus import CORPUS_VERSION
from verl_speco.target.model import TargetModelSpec
from verl_speco.target.tokenizer import TOKENIZER_VERSION
from verl_speco.target.train import TrainSpec

BUILD_VERSION = "2"
RECIPE_FILE = "recipe.json"
DIGESTS_KEY = "sha256"
WEIGHTS_FILE = "model.safetensors"
Log = Callable[[str], None]


class BuildDigestError(RuntimeError):
    """A built directory's files do not match the sha256 digests its recipe.json recorded."""


@dataclass(frozen=True)
class TargetRecipe:
    """Everything that determines the built target; its hash names the cache folder."""

    name: str = "tiny-qwen3"
    model: TargetModelSpec = field(default_factory=TargetModelSpec)
    train: TrainSpec = field(default_factory=TrainSpec)
    vocab_size: int = 512

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "versions": {"corpus": CORPUS_VERSION, "tokenizer": TOKENIZER_VERSION,
                                             "build": BUILD_VERSION}}

    @property
    def hash(self) -> str:
        return hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:12]

    @property
    def dirname(self) -> str:
        return f"{self.name}-{self.hash}"


def cache_root(cache_dir: str | Path | None = None) -> Path:
    """`cache_dir`, else `$VERL_SPECO_CACHE`, else `~/.cache/verl_speco`."""
    if cache_dir is not None:
        return Path(cache_dir)
    env = os.environ.get("VERL_SPECO_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "verl_speco"


def read_recipe_file(model_dir: str | Path) -> dict[str, Any] | None:
    """The `recipe.json` of a built directory, or None when the directory is not a complete build."""
    path = Path(model_dir) / RECIPE_FILE
    if not path.is_file():
        return None
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def sha256_file(path: Path) -> str:
    """Hex sha256 of the file's bytes."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def file_digests(directory: str | Path) -> dict[str, str]:
    """sha256 of every file in `directory` except RECIPE_FILE, by name (what a build records)."""
    return {p.name: sha256_file(p) for p in sorted(Path(directory).iterdir())
            if p.is_file() and p.name != RECIPE_FILE}


def verify_digests(model_dir: str | Path, info: dict[str, Any]) -> None:
    """Check the files of `model_dir` against the digests recorded in its recipe `info`.

    Raises BuildDigestError naming every file that is missing or changed, or when `info` records
    no digests (or none for the weights)."""
    recorded = info.get(DIGESTS_KEY)
    if not isinstance(recorded, dict) or WEIGHTS_FILE not in recorded:
        raise BuildDigestError(f"{model_dir}/{RECIPE_FILE} records no {DIGESTS_KEY} digest of {WEIGHTS_FILE}: "
                               "not a complete build of this version; rebuild with force=True / --force")
    problems = []
    for name, want in sorted(recorded.items()):
        path = Path(model_dir) / name
        got = sha256_file(path) if path.is_file() else "missing"
        if got != want:
            problems.append(f"{name}: sha256 {got}, recorded {want}")
    if problems:
        raise BuildDigestError(f"{model_dir} changed after it was built ({'; '.join(problems)}); "
                               "rebuild with force=True / --force")


@contextmanager
def _locked(final: Path) -> Iterator[None]:
    final.parent.mkdir(parents=True, exist_ok=True)
    with open(final.parent / f".{final.name}.lock", "w") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _share(directory: Path) -> None:
    """Give the build the usual umask permissions (mkdtemp creates it 0700, safetensors files 0600)."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(directory, 0o777 & ~umask)
    for path in directory.iterdir():
        os.chmod(path, 0o666 & ~umask)


def build_atomically(final: Path, expected_hash: str, force: bool, produce: Callable[[Path], None]) -> Path:
    """Run `produce(tmp_dir)` and rename tmp_dir to `final`, unless `final` already holds `expected_hash`.

    `produce` must write RECIPE_FILE (with "hash" and the `file_digests` of the other files) last. A
    cache hit (`final` holds `expected_hash`) is returned only once its files match the recorded
    digests (else BuildDigestError). A `final` holding another hash raises unless `force`, so a
    user-chosen `--out` is never silently overwritten."""
    with _locked(final):
        found = read_recipe_file(final)
        if found is not None and found.get("hash") == expected_hash and not force:
            verify_digests(final, found)
            return final
        if final.exists() and not force:
            raise FileExistsError(
                f"{final} exists but does not hold a target with recipe hash {expected_hash} "
                f"(found {None if found is None else found.get('hash')}); pass force=True / --force to replace it"
            )
        tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
        try:
            produce(tmp)
            built = read_recipe_file(tmp)
            if built is None:
                raise RuntimeError(f"build of {final} did not write {RECIPE_FILE}")
            verify_digests(tmp, built)
            _share(tmp)
            if final.exists():
                old = final.with_name(f".{final.name}.old-{os.getpid()}")
                os.rename(final, old)
                shutil.rmtree(old)
            os.rename(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
    return final
