"""How much of the shipped source is docstrings: docstring lines / all lines, read with `ast`.

    python tests/docstring_share.py [--top N] [PATH ...]   # default: verl_speco drafters feature_store

A docstring line is a line of a module, class or function docstring (the string statement's first
to last line); all lines are every line of the file, blank ones included. Prints the share per
top-level package and overall, then the N files with the most docstring lines.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = ("verl_speco", "drafters", "feature_store")


def docstring_lines(source: str) -> int:
    """Lines of `source` that belong to a module, class or function docstring."""
    count = 0
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                count += (first.end_lineno or first.lineno) - first.lineno + 1
    return count


def measure(paths: Iterable[Path]) -> dict[Path, tuple[int, int]]:
    """file -> (docstring lines, all lines) for every .py file under `paths`."""
    out: dict[Path, tuple[int, int]] = {}
    for top in paths:
        for path in sorted(top.rglob("*.py")) if top.is_dir() else [top]:
            text = path.read_text()
            out[path] = (docstring_lines(text), len(text.splitlines()))
    return out


def share(counts: Iterable[tuple[int, int]]) -> tuple[int, int, float]:
    """(docstring lines, all lines, their ratio) summed over `counts`."""
    doc = total = 0
    for d, t in counts:
        doc, total = doc + d, total + t
    return doc, total, doc / total if total else 0.0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("paths", nargs="*", default=[str(ROOT / s) for s in SHIPPED])
    p.add_argument("--top", type=int, default=15, help="files listed, most docstring lines first")
    args = p.parse_args(argv)
    for raw in args.paths:
        counts = measure([Path(raw)])
        doc, total, ratio = share(counts.values())
        print(f"{raw}: {doc} of {total} lines are docstrings ({ratio:.1%})")
    counts = measure(Path(raw) for raw in args.paths)
    doc, total, ratio = share(counts.values())
    print(f"overall: {doc} of {total} lines ({ratio:.1%})")
    for path, (d, t) in sorted(counts.items(), key=lambda kv: -kv[1][0])[:args.top]:
        print(f"  {d:5d} / {t:5d}  {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
