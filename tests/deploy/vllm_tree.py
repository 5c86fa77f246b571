"""A vLLM source tree, read with `ast` and never imported.

`VllmTree(root)` indexes the `vllm` package under `root` (e.g. the 0.24.0 wheel installed with
`pip install --no-deps --target DIR`, or the installed package's parent directory): which dotted
names exist (`resolve`), which attribute names anything in the tree defines (`defined`), and the
speculative-decoding facts a drafter depends on: the `SpeculativeConfig` fields, the accepted
`method` values and the registered speculative model architectures.
"""

from __future__ import annotations

import ast
import functools
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

SPECULATIVE_CONFIG = "vllm.config.speculative"
MODEL_REGISTRY = "vllm.model_executor.models.registry"
_DEFINERS = ("register_buffer", "register_parameter", "setattr")


class VllmTreeError(ValueError):
    """The directory does not hold a readable vLLM source tree."""


def _top_level(body: Iterable[ast.stmt]) -> Iterator[ast.stmt]:
    """Module or class statements, looking inside if/try blocks (TYPE_CHECKING, optional imports)."""
    for node in body:
        if isinstance(node, ast.If):
            yield from _top_level(node.body)
            yield from _top_level(node.orelse)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody, *[h.body for h in node.handlers]):
                yield from _top_level(block)
        else:
            yield node


def _bound(node: ast.stmt) -> list[str]:
    """Names a top-level statement binds."""
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
        return [node.name]
    if isinstance(node, ast.Import | ast.ImportFrom):
        return [(a.asname or a.name).split(".")[0] for a in node.names]
    targets = node.targets if isinstance(node, ast.Assign) else [node.target] \
        if isinstance(node, ast.AnnAssign | ast.AugAssign) else []
    return [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]


class VllmTree:
    def __init__(self, root: str | Path):
        self.root = Path(root)
        self.package = self.root / "vllm"
        if not (self.package / "__init__.py").is_file():
            raise VllmTreeError(f"{self.root}: no vllm/__init__.py, expected the directory holding the vllm package "
                                "(e.g. pip install --no-deps --target DIR vllm==X)")
        self.version = self._version()
        self._defined: dict[str, bool] = {}  # name -> defined somewhere in the tree (memo of `defined`)

    def _version(self) -> str:
        path = self.package / "_version.py"
        found = re.search(r"""__version__\s*=\s*(?:version\s*=\s*)?['"]([^'"]+)['"]""",
                          path.read_text() if path.is_file() else "")
        if found is None:
            raise VllmTreeError(f"{path}: no __version__ string, expected vLLM's generated version file")
        return found.group(1)

    def module_file(self, dotted: str) -> Path | None:
        base = self.root.joinpath(*dotted.split("."))
        for path in (base.with_suffix(".py"), base / "__init__.py"):
            if path.is_file():
                return path
        return None

    @functools.cache  # noqa: B019 (one tree per process, kept for its lifetime)
    def module_ast(self, dotted: str) -> ast.Module | None:
        path = self.module_file(dotted)
        return None if path is None else ast.parse(path.read_bytes(), filename=str(path))

    @functools.cache  # noqa: B019
    def module_names(self, dotted: str) -> frozenset[str]:
        """Top-level names of a module: definitions, imports, `__all__`, and the names a module-level
        `__getattr__` serves (string keys of module-level dicts and strings it compares against)."""
        tree = self.module_ast(dotted)
        if tree is None:
            return frozenset()
        names = {n for node in _top_level(tree.body) for n in _bound(node)}
        if "__getattr__" in names:
            for node in _top_level(tree.body):
                if isinstance(node, ast.Assign | ast.AnnAssign) and isinstance(node.value, ast.Dict):
                    names |= {k.value for k in node.value.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
                if isinstance(node, ast.FunctionDef) and node.name == "__getattr__":
                    names |= {c.value for c in ast.walk(node) if isinstance(c, ast.Constant) and isinstance(c.value, str)}
        return frozenset(names)

    def _import_source(self, module: str, name: str) -> str | None:
        """Where `name`, imported at module level of `module`, comes from (dotted), if a vLLM name."""
        tree = self.module_ast(module)
        is_package = (self.module_file(module) or Path()).name == "__init__.py"
        for node in _top_level(tree.body if tree else []):
            if not isinstance(node, ast.ImportFrom):
                continue
            for alias in node.names:
                if (alias.asname or alias.name) == name:
                    parts = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)] \
                        if node.level else []
                    return ".".join([*parts, *(node.module or "").split(".")]).strip(".") + "." + alias.name
        return None

    def _class(self, module: str, name: str) -> ast.ClassDef | None:
        tree = self.module_ast(module)
        return next((n for n in _top_level(tree.body if tree else []) if isinstance(n, ast.ClassDef)
                     and n.name == name), None)

    def _class_has(self, module: str, cls: ast.ClassDef, attr: str, depth: int = 0) -> bool:
        members = {n for node in _top_level(cls.body) for n in _bound(node)}
        members |= {t.attr for node in ast.walk(cls) if isinstance(node, ast.Assign | ast.AnnAssign)
                    for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
                    if isinstance(t, ast.Attribute)}
        if attr in members:
            return True
        for base in cls.bases:  # inherited: a base defined in or imported into the same module
            name = base.id if isinstance(base, ast.Name) else None
            if name is None or depth > 8:
                continue
            found = self._locate_class(module, name)
            if found is not None and self._class_has(found[0], found[1], attr, depth + 1):
                return True
        return False

    def _locate_class(self, module: str, name: str) -> tuple[str, ast.ClassDef] | None:
        cls = self._class(module, name)
        if cls is not None:
            return module, cls
        source = self._import_source(module, name)
        if source is None or not source.startswith("vllm."):
            return None
        owner, _, base = source.rpartition(".")
        return self._locate_class(owner, base) if self.module_file(owner) else None

    def resolve(self, dotted: str) -> str | None:
        """None when `dotted` (a module, a module attribute, or a class member one level down)
        exists in this tree, else what is missing."""
        parts = dotted.split(".")
        cut = max((i for i in range(1, len(parts) + 1) if self.module_file(".".join(parts[:i]))), default=0)
        if cut == 0:
            return f"no module {parts[0]!r}"
        module, rest = ".".join(parts[:cut]), parts[cut:]
        if not rest:
            return None
        if rest[0] not in self.module_names(module):
            return f"{module} has no {rest[0]!r}"
        if len(rest) == 1:
            return None
        located = self._locate_class(module, rest[0])
        if located is None:  # not a class of this tree (a function, a value): nothing more to check
            return None
        if not self._class_has(located[0], located[1], rest[1]):
            return f"class {located[0]}.{rest[0]} has no {rest[1]!r}"
        return None

    def defined(self, candidates: Iterable[str]) -> set[str]:
        """The candidates some file of the tree defines: a function or class name, an assignment target
        (a name, or an attribute such as `self.x`), or a register_buffer / register_parameter /
        setattr name. Files that do not mention a name still sought are not parsed."""
        asked = set(candidates)
        wanted = {n for n in asked if n not in self._defined}
        found: set[str] = set()
        for path in sorted(self.package.rglob("*.py")) if wanted else ():
            if not wanted:
                break
            text = path.read_text(errors="replace")
            if not re.search(r"\b(" + "|".join(sorted(map(re.escape, wanted))) + r")\b", text):
                continue
            here = _definitions(ast.parse(text, filename=str(path)), wanted)
            found |= here
            wanted -= here
        self._defined.update({n: n in found for n in asked if n not in self._defined})
        return {n for n in asked if self._defined[n]}

    def speculative_config_fields(self) -> set[str]:
        cls = self._class(SPECULATIVE_CONFIG, "SpeculativeConfig")
        if cls is None:
            raise VllmTreeError(f"{self.root}: no class SpeculativeConfig in {SPECULATIVE_CONFIG}")
        return {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}

    def speculative_methods(self) -> set[str]:
        """Every string `SpeculativeConfig.method` accepts: the `SpeculativeMethod` Literal, with the
        Literal aliases it names expanded."""
        tree = self.module_ast(SPECULATIVE_CONFIG)
        aliases = {node.targets[0].id: node.value for node in (tree.body if tree else [])
                   if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)}
        if "SpeculativeMethod" not in aliases:
            raise VllmTreeError(f"{self.root}: no SpeculativeMethod Literal in {SPECULATIVE_CONFIG}")

        def expand(node: ast.expr, seen: frozenset[str]) -> set[str]:
            out: set[str] = set()
            for sub in ast.walk(node):
                if isinstance(sub, ast.Constant) and isinstance(sub.value, str):
                    out.add(sub.value)
                elif isinstance(sub, ast.Name) and sub.id in aliases and sub.id not in seen:
                    out |= expand(aliases[sub.id], seen | {sub.id})
            return out

        return expand(aliases["SpeculativeMethod"], frozenset({"SpeculativeMethod"}))

    def speculative_architectures(self) -> set[str]:
        """The architecture names of vLLM's speculative-decoding model registry."""
        tree = self.module_ast(MODEL_REGISTRY)
        for node in tree.body if tree else []:
            if isinstance(node, ast.Assign | ast.AnnAssign) and isinstance(node.value, ast.Dict):
                target = node.targets[0] if isinstance(node, ast.Assign) else node.target
                if isinstance(target, ast.Name) and target.id == "_SPECULATIVE_DECODING_MODELS":
                    return {k.value for k in node.value.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)}
        raise VllmTreeError(f"{self.root}: no _SPECULATIVE_DECODING_MODELS dict in {MODEL_REGISTRY}")


def _definitions(tree: ast.Module, wanted: set[str]) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.stmt):
            found.update(n for n in _bound(node) if n in wanted)
        if isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign):
            for target in node.targets if isinstance(node, ast.Assign) else [node.target]:
                found.update(t.attr for t in ast.walk(target) if isinstance(t, ast.Attribute) and t.attr in wanted)
        elif isinstance(node, ast.Call) and node.args:
            func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            index = 1 if func == "setattr" else 0
            arg = node.args[index] if func in _DEFINERS and len(node.args) > index else None
            if isinstance(arg, ast.Constant) and arg.value in wanted:
                found.add(arg.value)
    return found
