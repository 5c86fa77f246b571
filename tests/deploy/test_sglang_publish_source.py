"""The draft-only weight-update contract `engines/sglang_publish.py` sends, checked against SGLang's source.

Both trees scripts/setup_env.sh installs off sys.path are read with `ast` (never imported): SGLang
0.5.12 (verl 0.9.1's pin, the gpu-sglang line) and 0.5.23. The contract: POST routes
/begin_weight_update, /update_weights_from_tensor and /end_weight_update; every field we send in
`UpdateWeightsFromTensorReqInput` (`selector` included) and `BeginWeightUpdateReqInput.selector`;
a `load_format == "flattened_bucket"` reader; a scheduler handler that routes by `recv_req.selector`.
Asserted: a release has the whole contract iff `live_publish_refusal` accepts it; 0.5.23 has it;
0.5.12 lacks exactly the listed parts, and its speculative workers write the target as
`SGLANG_GAPS` says (EAGLE workers load into the target runner too; the DFlash worker delegates to
the target worker); a planted missing field is caught.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path
from typing import Any

import pytest

from verl_speco.engines.sglang_http import ROUTES
from verl_speco.engines.sglang_publish import (
    CHECKED_SGLANG,
    OPTIONAL_FIELDS,
    REQUEST_FIELDS,
    SGLANG_GAPS,
    live_publish_refusal,
)

TREES = {"0.5.12": Path(sys.prefix) / "sglang_0512_ref", "0.5.23": Path(sys.prefix) / "sglang_ref"}
SESSION_ROUTES = ROUTES[:3]  # /begin_weight_update, /update_weights_from_tensor, /end_weight_update


def _parse(path: Path) -> ast.Module:
    if not path.is_file():
        pytest.fail(f"{path}: missing; scripts/setup_env.sh installs SGLang's source there (pip install --no-deps "
                    "--target <dir> sglang==<version>)")
    return ast.parse(path.read_text(), filename=str(path))


def _fields(tree: ast.Module, name: str) -> set[str] | None:
    """The annotated fields of top-level class `name` (None: no such class)."""
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return {n.target.id for n in node.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    return None


def _names(node: ast.AST) -> set[str]:
    """Every attribute and variable name used under `node`."""
    return {n.attr if isinstance(n, ast.Attribute) else n.id for n in ast.walk(node)
            if isinstance(n, ast.Attribute | ast.Name)}


def _methods(cls: ast.ClassDef) -> dict[str, ast.AST]:
    return {n.name: n for n in cls.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}


def publish_facts(root: Path) -> dict[str, Any]:
    srt = root / "sglang" / "srt"
    routes = set()
    for node in ast.walk(_parse(srt / "entrypoints" / "http_server.py")):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            for d in node.decorator_list:
                if isinstance(d, ast.Call) and isinstance(d.func, ast.Attribute) and d.func.attr in ("post", "api_route") \
                        and d.args and isinstance(d.args[0], ast.Constant):
                    routes.add(d.args[0].value)
    io_struct = _parse(srt / "managers" / "io_struct.py")
    flattened = any(isinstance(n, ast.Compare) and any(isinstance(c, ast.Constant) and c.value == "flattened_bucket"
                                                       for c in [n.left, *n.comparators])
                    for path in sorted((srt / "model_executor").rglob("*.py")) for n in ast.walk(_parse(path)))
    selects, into_target, delegates = False, set[str](), set[str]()
    for path in sorted((srt / "managers").rglob("*.py")):
        for node in ast.walk(_parse(path)):
            if isinstance(node, ast.FunctionDef) and node.name == "update_weights_from_tensor" and \
                    "recv_req" in [a.arg for a in node.args.args] and "selector" in _names(node):
                selects = True
    for path in sorted((srt / "speculative").rglob("*.py")):
        for cls in (n for n in _parse(path).body if isinstance(n, ast.ClassDef)):
            methods = _methods(cls)
            if "update_weights_from_tensor" in methods and "target_worker" in _names(methods["update_weights_from_tensor"]):
                into_target.add(cls.name)
            if "update_weights_from_tensor" not in methods and "__getattr__" in methods \
                    and "target_worker" in _names(methods["__getattr__"]):
                delegates.add(cls.name)
    return {"routes": routes, "tensor_fields": _fields(io_struct, "UpdateWeightsFromTensorReqInput") or set(),
            "begin_fields": _fields(io_struct, "BeginWeightUpdateReqInput"), "flattened_bucket": flattened,
            "scheduler_selects": selects, "into_target": into_target, "delegates_to_target": delegates}


def contract_gaps(facts: dict[str, Any]) -> list[str]:
    """What of the contract `SGLangDraftPublisher` + `SGLangHTTPClient` send a release lacks."""
    lacks = [f"route {r}" for r in SESSION_ROUTES if r not in facts["routes"]]
    lacks += [f"UpdateWeightsFromTensorReqInput.{f}" for f in REQUEST_FIELDS + OPTIONAL_FIELDS
              if f not in facts["tensor_fields"]]
    if "selector" not in (facts["begin_fields"] or set()):
        lacks.append("BeginWeightUpdateReqInput.selector")
    if not facts["flattened_bucket"]:
        lacks.append("load_format flattened_bucket")
    if not facts["scheduler_selects"]:
        lacks.append("scheduler routing by selector")
    return lacks


@pytest.fixture(scope="module")
def facts() -> dict[str, dict[str, Any]]:
    return {release: publish_facts(root) for release, root in TREES.items()}


@pytest.mark.parametrize("release", list(TREES))
def test_live_publish_is_refused_exactly_where_the_contract_is_missing(release: str,
                                                                       facts: dict[str, Any]) -> None:
    version = (TREES[release] / "sglang" / "_version.py").read_text()
    assert f"({', '.join(release.split('.'))})" in version, f"{TREES[release]} is not SGLang {release}"
    lacking = contract_gaps(facts[release])
    print(f"SGLang {release} lacks:", lacking)
    assert (live_publish_refusal(release) is None) == (lacking == [])
    if release == "0.5.12":
        assert lacking == ["route /begin_weight_update", "route /end_weight_update",
                           "UpdateWeightsFromTensorReqInput.selector", "BeginWeightUpdateReqInput.selector",
                           "scheduler routing by selector"]
        assert "/update_weights_from_tensor" in facts[release]["routes"]  # only the draft-only part is missing
        # SGLANG_GAPS' account of where 0.5.12 sends a tensor update
        assert {"EAGLEWorker", "EAGLEWorkerV2"} <= facts[release]["into_target"]
        assert "DFlashWorker" in facts[release]["delegates_to_target"]
        assert "target runner" in SGLANG_GAPS[release] and "DFlash worker passes it to the target" in \
            SGLANG_GAPS[release]


def test_every_checked_release_has_its_source_read() -> None:
    assert set(CHECKED_SGLANG) <= set(TREES)
    assert set(SGLANG_GAPS) <= set(TREES) - set(CHECKED_SGLANG)


def test_a_planted_missing_field_is_caught(facts: dict[str, Any]) -> None:
    planted = {**facts["0.5.23"], "tensor_fields": facts["0.5.23"]["tensor_fields"] - {"selector"}}
    assert contract_gaps(planted) == ["UpdateWeightsFromTensorReqInput.selector"]
    assert contract_gaps({**facts["0.5.23"], "flattened_bucket": False}) == ["load_format flattened_bucket"]
