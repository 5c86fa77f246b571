"""What the NPU launchers ask of vllm-ascend, checked against vllm-ascend 0.23.0's own source.

The wheel is fetched with `pip download --no-deps` and its `.py` files read with `ast` off sys.path
(tests/deploy/wheel_source.py), never imported (it needs torch_npu and CANN). Asserted:
- the release is the versions file's ascend line's, and `verl_speco.deploy.vllm_ascend`'s facts are
  its source's: the speculative methods its runner builds proposers for (no dspark), the verify
  limit k + 1 <= 16, the speculative_config fields its proposers read;
- every family the NPU launchers serve asks for a method it has, at most 16 verified tokens, and
  only speculative_config keys it reads (or vLLM's own draft `model`);
- the in-place draft reload reaches only what vllm-ascend has: its NPU model runner holds the
  proposer as `drafter`, its base proposer's `load_model` installs `model` and P-EAGLE's mask-slot
  state from the attributes our recomputation reads, and its DFlash patch reads exactly the fused
  buffers our rebuild writes (all read from our own source with `ast` too);
- planted: the same checks on a copy without the dflash branch, or with a limit of 8, or with the
  proposer renamed, or with the DFlash patch reading another buffer, fail.
"""

from __future__ import annotations

import ast
import inspect
import shutil
import textwrap
from pathlib import Path

import pytest

from deploy.wheel_source import wheel_source
from verl_speco.deploy import vllm_ascend
from verl_speco.deploy.versions import load_versions
from verl_speco.deploy.vllm_ascend import AscendTree
from verl_speco.engines import vllm_reload
from verl_speco.launchers import online, recipes

VLLM_OWN = {"model"}  # read by vLLM's SpeculativeConfig itself (vllm==0.23.0), not by vllm-ascend


@pytest.fixture(scope="module")
def source() -> Path:
    return wheel_source("vllm-ascend", vllm_ascend.ASCEND_RELEASE, "vllm_ascend")


def npu_requests() -> dict[str, tuple[dict[str, object], int]]:
    """family -> (the speculative_config the NPU launcher makes vllm-ascend start with, k)."""
    out = {}
    for family, _ in recipes.served("npu"):
        values = recipes.settings(family, "npu")
        k = recipes.speculative_tokens(family, values)
        spec = recipes.engine_speculative_args(family, "vllm", values, k, "npu")
        if family in online.EAGER_DRAFT:
            spec["enforce_eager"] = True
        out[family] = (spec, k)
    return out


def gaps(tree: AscendTree) -> dict[str, list[str]]:
    methods, limit, reads = tree.spec_methods(), tree.verify_limit(), tree.speculative_config_reads()
    found: dict[str, list[str]] = {}
    for family, (spec, k) in npu_requests().items():
        lacks = [] if spec["method"] in methods else [f"method {spec['method']!r}"]
        lacks += [f"k + 1 = {k + 1} > {limit}"] if k + 1 > limit else []
        lacks += [f"key {key!r}" for key in spec if key not in reads | VLLM_OWN]
        if lacks:
            found[family] = lacks
    return found


def test_the_facts_are_vllm_ascend_0230s(source: Path) -> None:
    tree = AscendTree(source)
    assert tree.version == load_versions().line("ascend")["vllm_ascend"] == vllm_ascend.ASCEND_RELEASE
    assert tree.spec_methods() == vllm_ascend.SPEC_METHODS and "dspark" not in tree.spec_methods()
    assert tree.verify_limit() == vllm_ascend.MAX_VERIFY_TOKENS == 16
    assert vllm_ascend.SPEC_FIELDS_READ <= tree.speculative_config_reads()


def test_every_npu_launcher_asks_only_what_it_serves(source: Path) -> None:
    requests = npu_requests()
    assert set(requests) == {"eagle1", "eagle2", "eagle3", "dflash", "peagle"}
    assert requests["dflash"][0]["enforce_eager"] is True and requests["peagle"][0]["parallel_drafting"] is True
    assert gaps(AscendTree(source)) == {}


def planted_copy(source: Path, dest: Path, edits: dict[str, tuple[str, str]]) -> AscendTree:
    """A copy of the source under `dest` with `old` replaced by `new` in each file `rel` of `edits`."""
    shutil.copytree(source / "vllm_ascend", dest / "vllm_ascend")
    for rel, (old, new) in edits.items():
        path = dest / "vllm_ascend" / rel
        path.write_text(path.read_text().replace(old, new))
    return AscendTree(dest)


def test_a_planted_source_change_is_caught(source: Path, tmp_path: Path) -> None:
    planted = gaps(planted_copy(source, tmp_path, {
        "spec_decode/__init__.py": ('method == "dflash"', 'method == "dflash_renamed"'),
        "attention/attention_v1.py": ("self.decode_threshold <= 16", "self.decode_threshold <= 8")}))
    assert planted["dflash"] == ["method 'dflash'", "k + 1 = 15 > 8"], planted
    assert planted["peagle"] == ["k + 1 = 9 > 8"] and "eagle3" not in planted


def _attrs(fn: object, base: str, ctx: type[ast.expr_context]) -> set[str]:
    """`<base>.<name>` set (Store) or read (Load) in our function `fn`, plus getattr(<base>, "<name>")."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))  # type: ignore[arg-type]
    out = {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.ctx, ctx)
           and isinstance(n.value, ast.Name) and n.value.id == base}
    if ctx is ast.Load:
        out |= {c.args[1].value for c in ast.walk(tree) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)
                and c.func.id == "getattr" and isinstance(c.args[0], ast.Name) and c.args[0].id == base
                and isinstance(c.args[1], ast.Constant)}
    return out


def reload_gaps(tree: AscendTree) -> list[str]:
    """What our draft reload reaches that this vllm-ascend source does not have."""
    found = []
    if vllm_ascend.RUNNER_DRAFT_ATTR not in tree.runner_assigns():
        found.append(f"NPUModelRunner sets no self.{vllm_ascend.RUNNER_DRAFT_ATTR}")
    missing = vllm_ascend.PROPOSER_READS - tree.proposer_load_model_attrs()
    if missing:
        found.append(f"AscendSpecDecodeBaseProposer.load_model lacks {sorted(missing)}")
    if tree.dflash_patch_reads() != vllm_ascend.DFLASH_PATCH_BUFFERS:
        found.append(f"the DFlash patch reads {sorted(tree.dflash_patch_reads())}")
    return found


def test_the_draft_reload_reaches_only_what_vllm_ascend_has(source: Path) -> None:
    assert reload_gaps(AscendTree(source)) == []
    # ours, read the same way: the runner attribute, the proposer attributes and the DFlash buffers
    assert vllm_ascend.RUNNER_DRAFT_ATTR in _attrs(vllm_reload.DraftReloadMixin._speco_drafter, "runner", ast.Load)
    assert _attrs(vllm_reload._refresh_parallel_drafting_hidden, "drafter", ast.Load) <= vllm_ascend.PROPOSER_READS
    assert vllm_ascend.DFLASH_PATCH_BUFFERS <= _attrs(vllm_reload._rebuild_dflash_buffers, "inner", ast.Store)
    assert vllm_ascend.ASCEND_RELEASE in vllm_reload.PATCHED_VLLM  # vllm-ascend 0.23.0 runs on vLLM 0.23.0


def test_a_planted_reload_change_is_caught(source: Path, tmp_path: Path) -> None:
    planted = planted_copy(source, tmp_path, {
        "worker/model_runner_v1.py": ("self.drafter", "self.proposer"),
        "patch/worker/patch_qwen3_dflash.py": ("self._fused_kv_bias", "self._fused_kv_bias_v2")})
    assert reload_gaps(planted) == [
        "NPUModelRunner sets no self.drafter",
        "the DFlash patch reads ['_fused_kv_bias_v2', '_fused_kv_weight']"]
