"""EAGLE-2 family: EAGLE-1 weights (same training, export tensors, loader), dynamic-tree drafting
(greedy and sampling lossless), engine arguments (SGLang tree, vLLM eagle chain)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from drafter_targets import TargetOutput, tiny_spec
from test_eagle1_expand import trained_eagle1
from test_tree_decode import CHI2_26_DOF_P001, _chi_square, _trigram
from tree_targets import MaskedTinyTarget, PrevTokenTarget, hf_qwen3

import drafters.verify as verify
from drafters import eagle1
from drafters.common.metrics import AcceptanceStats
from drafters.common.sampling import SamplingParams
from drafters.common.target import TargetHead
from drafters.common.tree import TreeConfig, TreeDrafterFamily
from drafters.eagle1.export import check_export
from drafters.eagle2 import FAMILY, Eagle2Config, Eagle2ExportConfig
from drafters.registry import available_families, engine_format_from_dict, export_family, get_family
from drafters.spec_decode import autoregressive_generate, speculative_generate, tree_speculative_generate
from verl_speco.evaluation import EvalPrompts, reference_acceptance

CFG = Eagle2Config(attn_backend="sdpa", top_k=3, depth=3, total_tokens=9)


def test_catalog_config_and_protocol() -> None:
    assert "eagle2" in available_families() and get_family("eagle2") is FAMILY
    assert isinstance(FAMILY, TreeDrafterFamily) and not isinstance(eagle1.FAMILY, TreeDrafterFamily)
    assert (Eagle2Config().top_k, Eagle2Config().depth, Eagle2Config().total_tokens) == (4, 4, 16)
    assert FAMILY.tree_config(CFG).pool_size == 3 + 2 * 9
    with pytest.raises(ValueError, match="top_k = 1 is the EAGLE-1 chain"):
        Eagle2Config(top_k=1, depth=3, total_tokens=3)
    with pytest.raises(ValueError, match="total_tokens=22"):
        Eagle2Config(top_k=3, depth=3, total_tokens=22)
    with pytest.raises(TypeError, match="expected Eagle2Config"):
        FAMILY.build(eagle1.Eagle1Config(), MaskedTinyTarget(tiny_spec()).head())


@pytest.fixture(scope="module")
def trained() -> Iterator[tuple[MaskedTinyTarget, torch.nn.Module]]:
    threads = torch.get_num_threads()
    torch._C.set_num_threads(1)
    yield trained_eagle1(FAMILY, CFG)  # asserts the loss halves
    torch._C.set_num_threads(threads)


def test_trains_exactly_like_eagle1(trained: tuple[MaskedTinyTarget, torch.nn.Module]) -> None:
    target, model = trained
    assert FAMILY.config_of(model) == CFG
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert grads and all(g is not None and bool(torch.isfinite(g).all()) for g in grads)
    _, same = trained_eagle1(eagle1.FAMILY, CFG.chain_config())  # same seed, data and steps
    assert model.state_dict().keys() == same.state_dict().keys()
    for k, v in model.state_dict().items():
        assert torch.equal(v, same.state_dict()[k]), k  # the tree settings change nothing in training


def test_export_loads_exactly_and_as_eagle1(trained: tuple[MaskedTinyTarget, torch.nn.Module], tmp_path: Path) -> None:
    target, model = trained
    head = target.head()
    out = FAMILY.export(model, CFG, head.spec, tmp_path / "e2")
    assert export_family(out) == "eagle2" and check_export(out).hidden_size == 16
    meta = json.loads((out / "verl_speco_meta.json").read_text())
    assert (meta["engine_format"]["top_k"], meta["engine_format"]["total_tokens"]) == (3, 9)
    back = FAMILY.load_export(out, head)
    assert FAMILY.config_of(back) == CFG  # the tree comes back from the export
    as_e1 = eagle1.FAMILY.load_export(out, head)  # an EAGLE-1 reader sees an EAGLE-1 draft
    for k, v in model.state_dict().items():
        assert torch.equal(back.state_dict()[k], v) and torch.equal(as_e1.state_dict()[k], v), k
    e1 = eagle1.FAMILY.export(as_e1, as_e1.cfg, head.spec, tmp_path / "e1")
    assert (e1 / "config.json").read_text() == (out / "config.json").read_text()
    assert (e1 / "model.safetensors").read_bytes() == (out / "model.safetensors").read_bytes()
    assert FAMILY.config_of(FAMILY.load_export(e1, head)) == Eagle2Config(**{**vars(CFG), "top_k": 4, "depth": 4,
                                                                             "total_tokens": 16})


def test_engine_tensors_and_formats(trained: tuple[MaskedTinyTarget, torch.nn.Module], tmp_path: Path) -> None:
    target, model = trained
    spec = target.spec
    fmt = FAMILY.engine_format(CFG, spec)
    e1 = eagle1.FAMILY.engine_format(CFG.chain_config(), spec)
    ours, theirs = fmt.engine_tensors(model.state_dict()), e1.engine_tensors(model.state_dict())
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert fmt.sglang_expected_shapes() == e1.sglang_expected_shapes()
    assert engine_format_from_dict(fmt.to_dict()) == fmt and isinstance(FAMILY.format_from_dict(fmt.to_dict()),
                                                                        Eagle2ExportConfig)
    with pytest.raises(ValueError, match="expected 'eagle1'"):
        e1.from_dict(fmt.to_dict())
    assert fmt.vllm_speculative_config(tmp_path, 3) == {"method": "eagle", "model": str(tmp_path),
                                                        "num_speculative_tokens": 3}
    sg = fmt.sglang_server_args(tmp_path, 3)
    assert sg == {"speculative_algorithm": "EAGLE", "speculative_draft_model_path": str(tmp_path),
                  "speculative_num_steps": 3, "speculative_eagle_topk": 3, "speculative_num_draft_tokens": 10}
    assert sg["speculative_eagle_topk"] > 1 and e1.sglang_server_args(tmp_path, 3)["speculative_eagle_topk"] == 1


@pytest.mark.parametrize("seed", [1, 2])
def test_tree_greedy_lossless_hf_qwen3(seed: int) -> None:
    target, head = hf_qwen3(seed=seed)
    torch.manual_seed(seed)
    model = FAMILY.build(CFG, head).eval()
    prompt = torch.tensor([4, 9, 2, 11])
    res = tree_speculative_generate(target, FAMILY.tree_proposer(model, head.spec), prompt,
                                    **vars(FAMILY.tree_config(CFG)), max_new_tokens=16)
    assert torch.equal(res.token_ids, autoregressive_generate(target, prompt, 16))
    assert res.stats.num_draft_tokens == 9 * res.stats.num_drafts


def test_trained_tree_is_lossless_and_accepts_more_than_chain(
        trained: tuple[MaskedTinyTarget, torch.nn.Module]) -> None:
    target, model = trained
    tree_p, chain_p = FAMILY.tree_proposer(model, target.spec), FAMILY.proposer(model, target.spec)
    chain, tree = AcceptanceStats(), AcceptanceStats()
    for prompt in (torch.tensor([4, 9, 2, 11]), torch.tensor([30, 1, 17, 5]), torch.tensor([8, 8, 21, 3])):
        ref = autoregressive_generate(target, prompt, 24)
        t = tree_speculative_generate(target, tree_p, prompt, top_k=3, depth=3, total_tokens=9, max_new_tokens=24)
        c = speculative_generate(target, chain_p, prompt, num_speculative_tokens=3, max_new_tokens=24)
        assert torch.equal(t.token_ids, ref) and torch.equal(c.token_ids, ref)
        tree, chain = tree.merge(t.stats), chain.merge(c.stats)
    # observed: tree (3, 3, 9) 3.08, chain k=3 2.24 (same weights, same depth)
    assert tree.mean_acceptance_length > chain.mean_acceptance_length + 0.4, (tree, chain)


class _EmbeddedTrigram(PrevTokenTarget):
    """PrevTokenTarget (mask-sensitive trigram law) whose hidden states are emb[token] [T, 8]."""

    def __init__(self, table: torch.Tensor, emb: torch.Tensor):
        super().__init__(table)
        self.emb = emb

    def forward(self, input_ids: torch.Tensor, output_hidden_states: bool = False,
                attention_mask: torch.Tensor | None = None, position_ids: torch.Tensor | None = None) -> TargetOutput:
        out = super().forward(input_ids, False, attention_mask, position_ids)
        h = self.emb[input_ids]
        return TargetOutput(out.logits, (h, h) if output_hidden_states else None)


def _eagle2_law(n: int, seed: int) -> tuple[dict[tuple[int, ...], int], dict[tuple[int, ...], float], list[int]]:
    table, law = _trigram()
    g = torch.Generator().manual_seed(0)
    spec = tiny_spec(vocab=3, hidden=8, layers=1, heads=2, kv_heads=1)
    head = TargetHead(spec, torch.randn(3, 8, generator=g), 3.0 * torch.randn(3, 8, generator=g), torch.ones(8))
    torch.manual_seed(2)
    model = FAMILY.build(Eagle2Config(attn_backend="sdpa", top_k=2, depth=2, total_tokens=4), head).eval()
    target, proposer = _EmbeddedTrigram(table, torch.randn(3, 8, generator=g)), FAMILY.tree_proposer(model, spec)
    counts: dict[tuple[int, ...], int] = {}
    lengths = [0, 0, 0]
    gen = torch.Generator().manual_seed(seed)
    for _ in range(n):
        res = tree_speculative_generate(target, proposer, torch.tensor([0, 1]), top_k=2, depth=2, total_tokens=4,
                                        max_new_tokens=3, sampling=SamplingParams(temperature=1.0), generator=gen)
        key = tuple(res.token_ids.tolist())
        counts[key] = counts.get(key, 0) + 1
        lengths[res.stats.accepted_per_pos[0] + res.stats.accepted_per_pos[1]] += 1
    return counts, law, lengths


def test_tree_sampling_lossless_with_the_eagle2_proposer(monkeypatch: pytest.MonkeyPatch) -> None:
    """test_tree_decode's criterion with the EAGLE-2 proposer drafting: n = 2000 (smallest expected
    cell count 2000 * 0.00267 = 5.3 > 5), chi-square over 27 cells below the P = 0.001 quantile."""
    n = 2000
    counts, law, lengths = _eagle2_law(n, seed=1)
    assert min(law.values()) * n > 5 and min(lengths) > 100, lengths  # paths of 0, 1 and 2 nodes all accepted
    assert _chi_square(counts, law, n) < CHI2_26_DOF_P001, _chi_square(counts, law, n)  # observed 21.2
    monkeypatch.setattr(verify, "recovered_distribution", lambda p, q, x: p)  # power: no residual
    bad, law, _ = _eagle2_law(400, seed=1)
    assert _chi_square(bad, law, 400) > 2 * CHI2_26_DOF_P001, _chi_square(bad, law, 400)  # observed 203


def test_reference_acceptance_decodes_eagle2_with_the_tree(tmp_path: Path) -> None:
    target, head = hf_qwen3(seed=1)
    target.save_pretrained(tmp_path / "target")  # type: ignore[operator]
    torch.manual_seed(0)
    model = FAMILY.build(CFG, head).eval()
    prompts = EvalPrompts(token_ids=[[4, 9, 2, 11], [3, 1, 4]], eos_token_id=31)
    e2 = FAMILY.export(model, CFG, head.spec, tmp_path / "e2")
    e1 = eagle1.FAMILY.export(model, CFG.chain_config(), head.spec, tmp_path / "e1")
    tree = reference_acceptance(tmp_path / "target", e2, prompts, k=3, max_new_tokens=12)
    chain = reference_acceptance(tmp_path / "target", e1, prompts, k=3, max_new_tokens=12)
    assert tree["tree"] == {"top_k": 3, "depth": 3, "total_tokens": 9} and chain["tree"] is None
    assert tree["num_draft_tokens"] == 9 * tree["num_drafts"] and chain["num_draft_tokens"] == 3 * chain["num_drafts"]
    forced = reference_acceptance(tmp_path / "target", e1, prompts, k=3, max_new_tokens=12,
                                  tree_shape=TreeConfig(2, 2, 4))  # a chain family's proposer with expand
    assert forced["tree"] == {"top_k": 2, "depth": 2, "total_tokens": 4} and forced["outputs"] == chain["outputs"]
    assert forced["num_draft_tokens"] == 4 * forced["num_drafts"]
    assert tree["outputs"] == chain["outputs"] == [autoregressive_generate(target, torch.tensor(p), 12,
                                                                           eos_token_id=31).tolist()
                                                   for p in prompts.token_ids]
    for res in (tree, chain, forced):  # the per-prompt counts add up to the pooled ones
        per = res["per_prompt"]
        assert per["generated"] == [len(o) for o in res["outputs"]] and sum(per["accepted"]) == res["num_accepted_tokens"]
        low, high = res["tokens_per_target_forward_interval90"]
        assert low <= res["tokens_per_target_forward"] <= high
