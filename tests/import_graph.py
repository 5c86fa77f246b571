"""The module import graph of our packages, read from the source (ast, no import is executed).

An edge a -> b means module `a` names module `b` in an import statement anywhere in its file:
top level, inside a function, or under `if TYPE_CHECKING:` (a function-level import still ties
the two files together; moving it into a function only hides the circle from Python). `from X
import y` is an edge to `X.y` when that is a module of ours, else to `X`; relative imports are
resolved against the importing module's package. Modules outside `packages` are ignored.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path


def module_files(root: Path, packages: Iterable[str]) -> dict[str, Path]:
    """Module name -> file for every .py under root/<package> (a package is its `__init__`)."""
    out: dict[str, Path] = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _resolve(name: str, modules: Mapping[str, Path]) -> str | None:
    """The longest prefix of `name` that is one of `modules` (None: not ours)."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in modules:
            return ".".join(parts[:n])
    return None


def _targets(module: str, path: Path, modules: Mapping[str, Path]) -> set[str]:
    is_package = path.name == "__init__.py"
    package = module if is_package else module.rpartition(".")[0]
    named: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            named += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                source = ".".join([*base, *([node.module] if node.module else [])])
            else:
                source = node.module or ""
            named += [f"{source}.{a.name}" if f"{source}.{a.name}" in modules else source for a in node.names]
    return {t for n in named if (t := _resolve(n, modules)) is not None and t != module}


def import_graph(root: Path, packages: Iterable[str]) -> dict[str, set[str]]:
    """Module -> the modules of ours it imports (see the module docstring)."""
    modules = module_files(root, packages)
    return {m: _targets(m, p, modules) for m, p in modules.items()}


def import_cycles(graph: Mapping[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (each a set of files that import
    one another, directly or around a circle), each sorted; Tarjan's algorithm, iterative."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next((c for c in children if c in graph), None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    out.append(sorted(component))
    return sorted(out)


def upward_imports(graph: Mapping[str, set[str]], layers: Iterable[str]) -> list[tuple[str, str]]:
    """Edges from a top-level package to one listed after it in `layers` (lowest layer first)."""
    rank = {name: i for i, name in enumerate(layers)}
    return sorted((a, b) for a, targets in graph.items() for b in targets
                  if rank[a.split(".")[0]] < rank[b.split(".")[0]])
