"""One recipe per family: `configs/drafter/<family>.yaml` holds every family's sized settings (`recipes`:
gpu, npu over gpu, real_target over the quickstart preset); the launchers, presets and benchmarks read
them (`recipes.drafter_recipe`, Hydra interpolation), and none of the launchers or benchmarks writes a
family setting itself (an AST scan, shown to catch planted copies of the tables it replaced)."""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest
from file_modules import load_script
from speco_verl_helpers import ROOT

from drafters.registry import get_family, known_families
from verl_speco.launchers import recipes
from verl_speco.train.compose import compose_raw, load_config

PATHS = ["target.path=/nonexistent/target", "data.store=/nonexistent/store"]
FAMILIES = ("eagle1", "eagle2", "eagle3", "dflash", "dspark", "domino", "peagle")
QWEN3_MASK = {"mask_token_id": 151669}
# the launchers' settings before the recipes moved to configs/drafter (published Qwen3-8B recipes)
GPU = {"eagle1": {}, "eagle2": {"top_k": 10, "depth": 7, "total_tokens": 60},
       "eagle3": {"draft_vocab_size": 32000, "ttt_steps": 7, "ttt_decay": 0.8},
       "dflash": {"num_layers": 5, "block_size": 16, **QWEN3_MASK},
       "dspark": {"num_layers": 5, "block_size": 7, "markov_head_type": "vanilla", **QWEN3_MASK},
       "domino": {"num_layers": 5, "block_size": 16, **QWEN3_MASK},
       "peagle": {"draft_vocab_size": 32000, "num_layers": 4, "num_depths": 8, **QWEN3_MASK}}
# the family benchmark's real-target overrides, exactly as its run records key them
REAL_TARGET = {"eagle1": [], "eagle2": [], "eagle3": ["drafter.settings.draft_vocab_size=8192"],
               "dflash": ["drafter.settings.num_anchors=64"], "dspark": ["drafter.settings.num_anchors=64"],
               "domino": ["drafter.settings.num_anchors=64"], "peagle": ["+drafter.settings.draft_vocab_size=8192"]}


def test_the_recipes_are_the_published_ones() -> None:
    assert tuple(known_families()) == FAMILIES
    for family in FAMILIES:
        assert recipes.settings(family, "gpu") == GPU[family], family
        npu = {**GPU[family], **({"block_size": 15} if family == "dflash" else {})}
        assert recipes.settings(family, "npu") == npu, family
    k = {d: recipes.speculative_tokens("dflash", recipes.settings("dflash", d)) for d in ("gpu", "npu", "cpu")}
    assert k == {"gpu": 15, "npu": 14, "cpu": 3}  # blocks of 16, 15 (vllm-ascend), 4 (quickstart)
    assert recipes.QWEN3_MASK_ID == QWEN3_MASK["mask_token_id"]


def test_every_family_has_one_drafter_file() -> None:
    """`drafter=<family>` composes and validates; each recipe is a subset of the family's config class
    and builds it (npu over gpu, real_target over the quickstart preset)."""
    assert sorted(p.stem for p in (ROOT / "configs" / "drafter").glob("*.yaml")) == sorted(FAMILIES)
    for family in FAMILIES:
        cfg = load_config([*PATHS, f"drafter={family}"])
        assert cfg.drafter.family == family and sorted(cfg.drafter.recipes) == sorted(recipes.RECIPES), family
        recipes.family_config(family, recipes.settings(family, "npu"))
        real_target = {**recipes.settings(family, "cpu"), **recipes.drafter_recipe(family, "real_target")}
        recipes.family_config(family, real_target)
    with pytest.raises(recipes.RecipeError, match=r"recipe='cpu': expected one of gpu, npu, real_target"):
        recipes.drafter_recipe("dflash", "cpu")


def test_a_missing_recipe_section_fails_naming_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "dflash.yaml").write_text("family: dflash\nsettings: {}\nrecipes:\n  gpu: {block_size: 16}\n")
    monkeypatch.setattr(recipes, "DRAFTER_DIR", tmp_path)
    assert recipes.drafter_recipe("dflash", "gpu") == {"block_size": 16}
    with pytest.raises(recipes.RecipeError, match=r"dflash\.yaml: recipes\.npu is None, expected a mapping"):
        recipes.settings("dflash", "npu")


def test_presets_and_the_bench_read_the_recipes() -> None:
    """The Qwen3-8B preset takes the gpu recipe, the smollm2 presets and the family benchmark the
    real_target one; the benchmark's overrides are the strings its cached runs were keyed by."""
    q = load_config([*PATHS, "preset=qwen3_8b_eagle3"]).drafter.settings
    assert {key: q[key] for key in GPU["eagle3"]} == GPU["eagle3"]
    bench = load_script("bench_family_acceptance")
    for family in FAMILIES:
        real = recipes.drafter_recipe(family, "real_target")
        smol = load_config([*PATHS, f"preset=quickstart_{family}_smollm2"]).drafter.settings
        assert {key: smol[key] for key in real} == real, family
        assert bench._target_settings(family, "smollm2-135m") == REAL_TARGET[family], family
    assert compose_raw(["preset=quickstart_dflash_smollm2"]).drafter.recipes.real_target.num_anchors == 64


# -- no family setting outside configs/ ---------------------------------------------------------------------

SCANNED = sorted([*(ROOT / "verl_speco" / "launchers").glob("*.py"), *(ROOT / "scripts").glob("bench_*.py")])
# a bench's own arguments that happen to share a setting's name, each with why it is no family recipe
EXEMPT = {("scripts/bench_train_step.py", "QUICK"):
          "--quick's toy sizes for every family (a seconds-long smoke run)"}
OVERRIDE = re.compile(r"[+~]*[\w.]*settings\.(\w+)=\S+")  # a whole string (prose examples are not)


def setting_keys() -> set[str]:
    return {f.name for name in FAMILIES for f in dataclasses.fields(get_family(name).config_cls)}


def _literal(node: ast.AST) -> bool:
    """A value written in place: a constant, -constant, an ALL_CAPS name, or a list / tuple of them."""
    if isinstance(node, ast.UnaryOp):
        return _literal(node.operand)
    if isinstance(node, (ast.List, ast.Tuple)):
        return all(_literal(e) for e in node.elts)
    return isinstance(node, ast.Constant) or (isinstance(node, ast.Name) and node.id.isupper())


def written_settings(source: str, where: str) -> list[str]:
    """Every family setting `source` writes with a literal value: a dict entry or `dict(...)` keyword
    named like a setting, a `x["<setting>"] = value` assignment, a string that is a whole
    `...settings.<key>=<value>` override (an example inside prose is not)."""
    keys, found = setting_keys(), []
    tree = ast.parse(source)
    exempt = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Assign) and len(n.targets) == 1
              and isinstance(n.targets[0], ast.Name) and (where, n.targets[0].id) in EXEMPT}
    skip = {id(c) for n in ast.walk(tree) if id(n) in exempt for c in ast.walk(n)}
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        pairs: list[tuple[Any, ast.AST]] = []
        if isinstance(node, ast.Dict):
            pairs = [(k.value, v) for k, v in zip(node.keys, node.values, strict=True) if isinstance(k, ast.Constant)]
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "dict":
            pairs = [(kw.arg, kw.value) for kw in node.keywords]
        elif isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Subscript):
            sub = node.targets[0].slice
            pairs = [(sub.value, node.value)] if isinstance(sub, ast.Constant) else []
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            m = OVERRIDE.fullmatch(node.value)
            found += [f"{where}:{node.lineno}: {node.value}"] if m and m.group(1) in keys else []
        found += [f"{where}:{node.lineno}: {key}" for key, value in pairs if key in keys and _literal(value)]
    return found


def test_no_launcher_or_bench_writes_a_family_setting() -> None:
    assert len(SCANNED) >= 10 and all(str(rel) in {str(p.relative_to(ROOT)) for p in SCANNED} for rel, _ in EXEMPT)
    found = [hit for path in SCANNED for hit in written_settings(path.read_text(), str(path.relative_to(ROOT)))]
    assert found == [], "family settings belong in configs/drafter/<family>.yaml `recipes`:\n" + "\n".join(found)


@pytest.mark.parametrize("planted", [
    'GPU_SETTINGS = {"dflash": {"num_layers": 5, "block_size": 16, "mask_token_id": QWEN3_MASK_ID}}',
    'NPU_SETTINGS = {"dflash": dict(block_size=15)}',
    'REAL = {"peagle": ["+drafter.settings.draft_vocab_size=8192"]}',
    'def f(values):\n    values["ttt_steps"] = -7\n    return values',
    'x = f"{p}actor_rollout_ref.rollout.drafter.settings.num_depths=8"',
])
def test_the_scan_finds_planted_settings(planted: str) -> None:
    launcher = (ROOT / "verl_speco" / "launchers" / "online.py").read_text()
    assert written_settings(launcher, "online.py") == []
    assert written_settings(launcher + "\n" + planted + "\n", "online.py")
    quick = (ROOT / "scripts" / "bench_train_step.py").read_text()
    assert written_settings(quick, "scripts/bench_train_step.py") == []
    assert written_settings(quick, "scripts/bench_train_step2.py")  # the exemption is by file and name
