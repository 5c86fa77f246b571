"""Our use of vLLM, found by reading our own source with `ast`, checked against a vLLM source tree.

`scan_uses(files)` finds, in every module of ours that imports vllm:
- "import": each imported vLLM module or name (`from vllm.x import y` -> "vllm.x.y");
- "attribute": each attribute chain on a name bound to a vLLM module or class, also through a
  plain alias (`cls = qwen3_dflash.DFlashQwen3Model; cls._normalize_context_k` ->
  "vllm.model_executor.models.qwen3_dflash.DFlashQwen3Model._normalize_context_k");
- "name": every other attribute name it reads or writes, and the names it passes to
  getattr / setattr / hasattr: the internals of vLLM objects it reaches at run time
  (`model_runner.drafter`, `parallel_drafting_hidden_state_tensor`, ...).
A module's `PATCHED_VLLM` (a release or a tuple of them) scopes its uses: the module refuses any
other vLLM version, so a tree of another version is not held to them (reported as skipped).

`check_uses(tree, uses, reference)`: imports and attribute chains must resolve in `tree`; a
"name" must be defined in `tree` whenever `reference` (the installed vLLM we run) defines it and
it is not torch's or Python's own (a name the reference does not define is not vLLM's).
"""

from __future__ import annotations

import ast
import builtins
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from deploy.vllm_tree import VllmTree

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("verl_speco", "scripts", "benchmarks")  # our code that may use vLLM (drafters/feature_store never do)
_DYNAMIC = ("getattr", "setattr", "hasattr", "delattr")


@dataclass(frozen=True)
class Use:
    kind: str  # "import" | "attribute" | "name"
    target: str
    where: str  # path:line
    scope: tuple[str, ...] | None  # the module's PATCHED_VLLM; None: every version


def _dotted(node: ast.expr) -> list[str] | None:
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.insert(0, node.attr)
        node = node.value
    return [node.id, *parts] if isinstance(node, ast.Name) else None


def _scope(tree: ast.Module, where: str) -> tuple[str, ...] | None:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "PATCHED_VLLM" for t in node.targets):
            value = ast.literal_eval(node.value)
            versions = (value,) if isinstance(value, str) else value
            if not isinstance(versions, tuple) or not versions or not all(isinstance(v, str) for v in versions):
                raise ValueError(f"{where}: PATCHED_VLLM = {value!r}, expected a release string or a tuple of them")
            return versions
    return None


def _imports_vllm(tree: ast.Module) -> bool:
    return any(isinstance(n, ast.Import) and any(a.name.split(".")[0] == "vllm" for a in n.names)
               or isinstance(n, ast.ImportFrom) and n.level == 0 and (n.module or "").split(".")[0] == "vllm"
               for n in ast.walk(tree))


def scan_file(path: Path, base: Path = ROOT) -> list[Use]:
    """The vLLM uses of one module ([] when it does not import vllm)."""
    rel = str(path.relative_to(base)) if path.is_relative_to(base) else str(path)
    tree = ast.parse(path.read_text(), filename=rel)
    if not _imports_vllm(tree):
        return []
    scope = _scope(tree, rel)
    uses: list[Use] = []
    bound: dict[str, str] = {}  # local name -> dotted vLLM name
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "vllm":
                    uses.append(Use("import", alias.name, f"{rel}:{node.lineno}", scope))
                    bound[alias.asname or "vllm"] = alias.name if alias.asname else "vllm"
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "vllm":
            for alias in node.names:
                uses.append(Use("import", f"{node.module}.{alias.name}", f"{rel}:{node.lineno}", scope))
                bound[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    for node in ast.walk(tree):  # plain aliases of bound names: `cls = module.Class`
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            chain = _dotted(node.value)
            if chain and chain[0] in bound:
                bound[node.targets[0].id] = ".".join([bound[chain[0]], *chain[1:]])
    chains: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and id(node) not in chains:
            chain = _dotted(node)
            inner: list[ast.Attribute] = []  # the chain's own attribute nodes (a call inside is walked on its own)
            link: ast.expr = node
            while isinstance(link, ast.Attribute):
                inner.append(link)
                link = link.value
            chains.update(id(n) for n in inner)
            if chain and chain[0] in bound:
                uses.append(Use("attribute", ".".join([bound[chain[0]], *chain[1:]]), f"{rel}:{node.lineno}", scope))
                continue
            for sub in inner:
                uses.append(Use("name", sub.attr, f"{rel}:{sub.lineno}", scope))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in _DYNAMIC \
                and len(node.args) > 1 and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
            uses.append(Use("name", node.args[1].value, f"{rel}:{node.lineno}", scope))
    return uses


def our_files(base: Path = ROOT, packages: Sequence[str] = SCANNED) -> list[Path]:
    return sorted(p for pkg in packages for p in (base / pkg).rglob("*.py"))


def scan_uses(files: Iterable[Path] | None = None, base: Path = ROOT) -> list[Use]:
    """Every vLLM use in `files` (default: all of our code that may use vLLM)."""
    return [use for path in (our_files(base) if files is None else files) for use in scan_file(path, base)]


def _not_vllms(name: str) -> bool:
    """torch's or Python's own names (a vLLM tree may define one too, e.g. a helper named `cat`)."""
    import torch

    owners = (builtins, str, bytes, dict, list, tuple, set, Path, torch, torch.Tensor, torch.nn.Module,
              torch.nn.Parameter)
    return name.startswith("__") or any(hasattr(owner, name) for owner in owners)


@dataclass(frozen=True)
class UseReport:
    version: str
    missing: tuple[str, ...]  # "<target> (<where>): <what is missing>"
    out_of_scope: tuple[str, ...]  # missing too, but only used by a module that refuses this version


def check_uses(tree: VllmTree, uses: Sequence[Use], reference: VllmTree | None = None) -> UseReport:
    """What of `uses` `tree` lacks; `reference` decides which names are vLLM's (default: `tree`)."""
    names = {u.target for u in uses if u.kind == "name" and not _not_vllms(u.target)}
    vllm_names = (reference or tree).defined(names)
    present = tree.defined(vllm_names) if reference is not None else vllm_names
    release = tree.version.split("+")[0]
    missing: list[str] = []
    out_of_scope: list[str] = []
    for use in uses:
        if use.kind == "name":
            problem = None if use.target not in vllm_names or use.target in present else \
                f"defined in vLLM {reference.version if reference else tree.version}, nowhere in {tree.version}"
        else:
            problem = tree.resolve(use.target)
        if problem is None:
            continue
        line = f"{use.target} ({use.where}): {problem}"
        if use.scope is not None and release not in use.scope:
            out_of_scope.append(f"{line}; its module patches vLLM {', '.join(use.scope)} only and refuses "
                                f"{tree.version}")
        else:
            missing.append(line)
    return UseReport(tree.version, tuple(dict.fromkeys(missing)), tuple(dict.fromkeys(out_of_scope)))
