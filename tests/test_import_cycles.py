"""No import circle among our modules and no upward import between our packages.

The graph is read from the source (tests/import_graph.py): imports inside functions and under
`if TYPE_CHECKING:` count, so a circle cannot hide in a function body. A circle means a definition
sits in the wrong file; move it to the file both sides can import.
"""

from __future__ import annotations

from pathlib import Path

from import_graph import import_cycles, import_graph, upward_imports

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("feature_store", "drafters", "verl_speco", "experiments")  # a package imports only those before it


def test_our_modules_import_no_circle() -> None:
    graph = import_graph(ROOT, LAYERS)
    assert len(graph) > 100 and "verl_speco.deploy.engine_check" in graph  # the scan sees the packages
    assert import_cycles(graph) == []


def test_no_package_imports_a_later_layer() -> None:
    assert upward_imports(import_graph(ROOT, LAYERS), LAYERS) == []


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def test_a_planted_circle_through_a_function_and_type_checking_is_found(tmp_path: Path) -> None:
    _write(tmp_path, {
        "low/__init__.py": "",
        "low/a.py": "def f():\n    from low.b import g\n",
        "low/b.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .c import h\n",
        "low/c.py": "from low import a\n",
        "low/d.py": "import low.a\n",  # into the circle, not part of it
        "top/__init__.py": "",
        "top/x.py": "from low.a import f\nimport os\n",  # downward and third-party: fine
    })
    graph = import_graph(tmp_path, ("low", "top"))
    assert graph["low.c"] == {"low.a"} and graph["low.b"] == {"low.c"} and graph["top.x"] == {"low.a"}
    assert import_cycles(graph) == [["low.a", "low.b", "low.c"]]
    assert upward_imports(graph, ("low", "top")) == []
    _write(tmp_path, {"low/d.py": "def late():\n    from top.x import f\n"})
    graph = import_graph(tmp_path, ("low", "top"))
    assert upward_imports(graph, ("low", "top")) == [("low.d", "top.x")]


def test_two_separate_circles_are_reported_apart(tmp_path: Path) -> None:
    _write(tmp_path, {"p/__init__.py": "", "p/a.py": "import p.b\n", "p/b.py": "from p import a\n",
                      "p/c.py": "from . import d\n", "p/d.py": "from .c import x\n", "p/e.py": "import p.a\n"})
    assert import_cycles(import_graph(tmp_path, ("p",))) == [["p.a", "p.b"], ["p.c", "p.d"]]
