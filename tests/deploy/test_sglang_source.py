"""The SGLang server flags each family writes, checked against SGLang's own source (read with `ast`).

Two source trees, both installed by scripts/setup_env.sh with `--no-deps --target` off sys.path:
SGLang 0.5.12 (verl 0.9.1's pin, the gpu-sglang line) in .venv/sglang_0512_ref and 0.5.23 in
.venv/sglang_ref. What a family writes comes from its own format (`sglang_server_args` of a tiny
export, tests/deploy/vllm_families.py `tiny_exports`). Per tree, a family is servable when its
`speculative_algorithm` is a member of `SpeculativeAlgorithm`, every flag is a `ServerArgs` field,
and, for a DFlash export with a `projector_type`, SGLang's DFlash model knows that projector.
Asserted: 0.5.23 serves every family with an SGLang method; 0.5.12 lacks exactly what
versions.toml refuses on it (DSpark and Domino); a planted unknown flag is caught.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

import pytest

from deploy.vllm_families import MAX_K, tiny_exports
from verl_speco.deploy.versions import load_versions

TREES = {"0.5.12": Path(sys.prefix) / "sglang_0512_ref", "0.5.23": Path(sys.prefix) / "sglang_ref"}


def _module(root: Path, rel: str) -> ast.Module:
    path = root / "sglang" / rel
    if not path.is_file():
        pytest.fail(f"{path}: missing; scripts/setup_env.sh installs SGLang's source there (pip install --no-deps "
                    f"--target {root} sglang==<version>)")
    return ast.parse(path.read_text(), filename=str(path))


def _class(tree: ast.Module, name: str) -> ast.ClassDef:
    found = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name]
    assert found, f"no class {name}"
    return found[0]


def sglang_facts(root: Path) -> dict[str, set[str]]:
    version = _module(root, "_version.py")
    # ServerArgs' own fields; newer releases assemble it from the namespaces of srt/arg_groups/fields/
    classes = [_class(_module(root, "srt/server_args.py"), "ServerArgs")]
    classes += [n for path in sorted((root / "sglang/srt/arg_groups/fields").glob("*.py"))
                for n in ast.parse(path.read_text()).body if isinstance(n, ast.ClassDef)]
    fields = {n.target.id for c in classes for n in c.body
              if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    algorithms = {t.id for n in _class(_module(root, "srt/speculative/spec_info.py"), "SpeculativeAlgorithm").body
                  if isinstance(n, ast.Assign) for t in n.targets if isinstance(t, ast.Name)}
    strings = {c.value for c in ast.walk(_module(root, "srt/models/dflash.py"))
               if isinstance(c, ast.Constant) and isinstance(c.value, str)}
    versions = {c.value for c in ast.walk(version) if isinstance(c, ast.Constant) and isinstance(c.value, str)}
    return {"fields": fields, "algorithms": algorithms, "dflash_strings": strings, "version": versions}


def _server_args(fmt: Any, directory: Path) -> dict[str, Any]:
    for candidate in (fmt, dataclasses.replace(fmt, dtype="bfloat16") if hasattr(fmt, "dtype") else fmt):
        for k in range(1, MAX_K + 1):
            try:
                args: dict[str, Any] = candidate.sglang_server_args(directory, k)
                return args
            except ValueError:
                continue
    raise AssertionError(f"{fmt.family}: no num_speculative_tokens in 1..{MAX_K} accepted for SGLang")


@pytest.fixture(scope="module")
def flags(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    """family -> (its SGLang server args, its export's config.json)."""
    out = {}
    for name, (fmt, directory) in tiny_exports(tmp_path_factory.mktemp("exports"), "sglang").items():
        out[name] = (_server_args(fmt, directory), json.loads((directory / "config.json").read_text()))
    return out


def gaps(facts: dict[str, set[str]], flags: dict[str, tuple[dict[str, Any], dict[str, Any]]]) -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for name, (args, config) in flags.items():
        lacks = [] if args["speculative_algorithm"] in facts["algorithms"] else \
            [f"algorithm {args['speculative_algorithm']}"]
        lacks += [f"flag {key}" for key in args if key not in facts["fields"]]
        projector = (config.get("dflash_config") or {}).get("projector_type")
        if projector is not None and projector not in facts["dflash_strings"]:
            lacks.append(f"DFlash projector {projector!r}")
        if lacks:
            found[name] = lacks
    return found


@pytest.mark.parametrize("release", list(TREES))
def test_sglang_source_serves_what_versions_toml_says(release: str, flags: dict[str, Any]) -> None:
    facts = sglang_facts(TREES[release])
    assert release in facts["version"], f"{TREES[release]} is not SGLang {release}"
    assert set(flags) == {"eagle1", "eagle2", "eagle3", "dflash", "dspark", "domino"}  # every SGLang method
    lacking = gaps(facts, flags)
    print(f"SGLang {release} lacks:", lacking)
    refused = set(load_versions().limits("sglang", release))
    assert set(lacking) == refused
    if release == "0.5.12":
        assert lacking == {"dspark": ["algorithm DSPARK", "flag speculative_dspark_block_size"],
                           "domino": ["DFlash projector 'domino'"]}
    if release == load_versions().line("gpu-sglang")["sglang"]:
        assert refused == {"dspark", "domino"}


def test_a_planted_unknown_flag_is_caught(flags: dict[str, Any]) -> None:
    facts = sglang_facts(TREES["0.5.23"])
    args, config = flags["dspark"]
    assert "speculative_dspark_block_size" in args  # 0.5.23 has it (arg_groups/fields/spec.py), 0.5.12 does not
    planted = {"dspark": ({**args, "speculative_dspark_gamma": 3}, config)}
    assert gaps(facts, planted) == {"dspark": ["flag speculative_dspark_gamma"]}
    assert gaps(facts, {"dflash": ({**flags["dflash"][0], "speculative_algorithm": "DFLASH2"}, {})}) == \
        {"dflash": ["algorithm DFLASH2"]}
