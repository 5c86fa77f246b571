"""EAGLE-2 dynamic-tree decoding: golden masks/positions, expand + rerank by hand, tree pass ==
path-by-path causal pass (HF Qwen3), greedy and sampling losslessness, chain equivalence."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pytest
import torch
from drafter_targets import tiny_spec
from tree_targets import MaskedTinyTarget, PrevTokenTarget, TableTreeDrafter, TargetTreeDrafter, hf_qwen3

import drafters.spec_decode as spec_decode
import drafters.verify as verify
from drafters.common.contract import DraftContext
from drafters.common.metrics import AcceptanceStats
from drafters.common.sampling import SamplingParams
from drafters.common.tree import (
    DraftTree,
    TreeConfig,
    TreeNodes,
    build_draft_tree,
    tree_attention_mask,
    tree_position_ids,
)
from drafters.eagle3 import FAMILY, Eagle3Config
from drafters.eagle3.proposer import Eagle3Proposer
from drafters.spec_decode import (
    autoregressive_generate,
    speculative_generate,
    target_forward,
    target_tree_forward,
    tree_speculative_generate,
)
from drafters.verify import verify_tree_greedy, verify_tree_sampling

AUX = (1, 2, 3)


def _m(rows: list[str]) -> torch.Tensor:
    return torch.tensor([[c == "1" for c in r.replace(" ", "")] for r in rows])


# the module docstring's example plus a depth-3 node e under c:  root ─ a ─ c ─ e / a ─ d / b
PARENTS = torch.tensor([-1, -1, 0, 0, 2])
DEPTHS = torch.tensor([1, 1, 2, 2, 3])


def test_tree_mask_and_positions_by_hand() -> None:
    expected = _m(["10 00000", "11 00000",
                   "11 10000",   # a: root's child
                   "11 01000",   # b: not its sibling a
                   "11 10100",   # c: a, itself
                   "11 10010",   # d: a, itself (not its sibling c)
                   "11 10101"])  # e: a, c, itself
    assert torch.equal(tree_attention_mask(PARENTS, 2), expected)
    assert tree_position_ids(DEPTHS, 2).tolist() == [0, 1, 2, 2, 3, 3, 4]
    assert torch.equal(tree_attention_mask(torch.tensor([-1, 0, 1]), 1), _m(["1000", "1100", "1110", "1111"]))
    with pytest.raises(ValueError, match="depth"):
        DraftTree(torch.tensor([1, 2]), torch.tensor([-1, 0]), torch.tensor([1, 1]), torch.zeros(2))


# ----------------------------------------------------------------------------- expand + rerank by hand
DRAFT_TABLE = torch.tensor([[0.10, 0.55, 0.25, 0.10],   # after token 0
                            [0.70, 0.15, 0.10, 0.05],   # after token 1
                            [0.25, 0.25, 0.25, 0.25],
                            [0.50, 0.30, 0.15, 0.05]])  # after token 3 (the root below)


@pytest.mark.parametrize("total,tokens,parents", [
    (5, [0, 1, 1, 0, 0], [-1, -1, 0, 1, 2]),
    (7, [0, 1, 1, 0, 0, 2, 1], [-1, -1, 0, 1, 2, 0, 3])])
def test_expand_and_rerank_by_hand(total: int, tokens: list[int], parents: list[int]) -> None:
    # depth 1: A=0 (.5), B=1 (.3); depth 2 candidates C=A.1 (.275), D=A.2 (.125), E=B.0 (.21),
    # F=B.1 (.045) -> frontier C, E; depth 3: G=C.0 (.1925), H=C.1 (.04125), I=E.1 (.1155), J=E.2 (.0525)
    # rank: A .5, B .3, C .275, E .21, G .1925, D .125, I .1155, ...
    drafter = TableTreeDrafter(DRAFT_TABLE)
    ctx = DraftContext(torch.tensor([2, 3]), ())
    tree = build_draft_tree(drafter, ctx, TreeConfig(top_k=2, depth=3, total_tokens=total))
    assert tree.token_ids.tolist() == tokens and tree.parents.tolist() == parents
    vals = {5: [0.5, 0.3, 0.275, 0.21, 0.1925], 7: [0.5, 0.3, 0.275, 0.21, 0.1925, 0.125, 0.1155]}[total]
    torch.testing.assert_close(tree.values.exp(), torch.tensor(vals, dtype=torch.float64))
    assert [c.num_nodes for c in drafter.calls] == [0, 2, 4]  # root, then frontiers + their ancestors
    last = drafter.calls[-1]  # A, B, C, E: closed under parents
    assert last.token_ids.tolist() == [0, 1, 1, 0] and last.parents.tolist() == [-1, -1, 0, 1]
    with pytest.raises(ValueError, match="total_tokens"):
        TreeConfig(top_k=2, depth=3, total_tokens=11)  # pool = 2 + 2 * 4 = 10


def test_tree_verification_by_hand() -> None:
    tokens = torch.tensor([0, 1, 1, 0, 0])  # the 5-node tree above
    parents = torch.tensor([-1, -1, 0, 1, 2])
    logits = torch.full((6, 4), -5.0)
    for row, best in enumerate([1, 3, 0, 1, 2, 3]):  # target argmax per row (row 0 = root)
        logits[row, best] = 5.0
    assert verify_tree_greedy(tokens, parents, logits) == ([1, 3], 2)  # root -> B (1) -> E (0); E is a leaf
    logits[0] = torch.tensor([5.0, -5.0, -5.0, -5.0])  # root wants 0 -> A; A's row wants 3, A's only child C is 1
    assert verify_tree_greedy(tokens, parents, logits) == ([0], 3)
    # sampling, near one-hot rows except the root: 0.5 on A's token 0, 0.5 on B's token 1.
    # A is tried first (accepted w.p. 0.5); after its rejection p = [0, 1, 0, 0], so B is accepted.
    probs = torch.softmax(logits * 10, -1)
    probs[0] = torch.tensor([0.5, 0.5, 0.0, 0.0])
    g = torch.Generator().manual_seed(0)
    seen = [verify_tree_sampling(tokens, parents, probs, g) for _ in range(400)]
    assert {(tuple(path), nxt) for path, nxt in seen} == {((0,), 3), ((1, 3), 2)}
    assert 150 < sum(path == [0] for path, _ in seen) < 250
    stats = AcceptanceStats()
    stats.record(8, 3, num_positions=3)
    stats.record(8, 0, num_positions=3)
    assert (stats.mean_acceptance_length, stats.accepted_per_pos, stats.draft_acceptance_rate) == (2.5, [1, 1, 1], 3 / 16)


# ----------------------------------------------------------------------------- tree pass == causal path pass


def _paths(parents: torch.Tensor) -> list[list[int]]:
    tree = DraftTree(torch.zeros_like(parents), parents, _depths(parents), torch.zeros(parents.numel()))
    return [tree.path(i) for i in range(parents.numel())]


def _depths(parents: torch.Tensor) -> torch.Tensor:
    d: list[int] = []
    for p in parents.tolist():
        d.append(1 if p < 0 else d[p] + 1)
    return torch.tensor(d)


def _sibling_mask(parents: torch.Tensor, c: int) -> torch.Tensor:
    """A WRONG tree mask: each node also sees its earlier siblings."""
    mask = tree_attention_mask(parents, c)
    for i, p in enumerate(parents.tolist()):
        for j in range(i):
            if int(parents[j]) == p:
                mask[c + i, c + j] = True
    return mask


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_hf_tree_pass_equals_causal_path_passes(attn: str) -> None:
    target, _ = hf_qwen3(attn=attn)
    ctx = torch.tensor([3, 17, 5, 9])
    parents = torch.tensor([-1, -1, 0, 0, 2, 1, 4])
    nodes = torch.tensor([11, 4, 20, 7, 7, 30, 2])  # node 4 and node 3 share a token on different paths
    c, seq = ctx.numel(), torch.cat([ctx, nodes])
    depths = _depths(parents)
    logits, hidden = target_tree_forward(target, seq, tree_attention_mask(parents, c), tree_position_ids(depths, c))
    for i, path in enumerate(_paths(parents)):
        ref_logits, ref_hidden = target_forward(target, torch.cat([ctx, nodes[path]]))
        # float32, same kernels, only the key set differs: agreement to 1e-5 (observed ~0)
        torch.testing.assert_close(logits[c + i], ref_logits[-1], atol=1e-5, rtol=1e-5)
        for h, r in zip(hidden, ref_hidden):
            torch.testing.assert_close(h[c + i], r[-1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logits[:c], target_forward(target, ctx)[0], atol=1e-5, rtol=1e-5)
    # the test can fail: a node that sees its sibling, or sits at C + i instead of C + depth - 1
    bad, _ = target_tree_forward(target, seq, _sibling_mask(parents, c), tree_position_ids(depths, c))
    assert (bad[c + 1] - logits[c + 1]).abs().max() > 1e-2
    bad, _ = target_tree_forward(target, seq, tree_attention_mask(parents, c), torch.arange(seq.numel()))
    assert (bad[c + 1] - logits[c + 1]).abs().max() > 1e-2


def test_eagle3_expand_equals_chain_along_each_path() -> None:
    target = MaskedTinyTarget(tiny_spec(), seed=3)
    torch.manual_seed(0)
    model = FAMILY.build(Eagle3Config(aux_layer_ids=AUX, attn_backend="sdpa"), target.head())
    proposer = Eagle3Proposer(model)
    ids = torch.tensor([4, 9, 2, 11, 6])
    _, hs = target_forward(target, ids)
    ctx = DraftContext(ids, tuple(h[:-1] for h in hs))
    root = proposer.expand(ctx, TreeNodes.root_only())
    parents, tokens = torch.tensor([-1, -1, 0, 1, 2]), torch.tensor([7, 8, 1, 1, 30])
    chain: list[tuple[torch.Tensor, torch.Tensor]] = []  # (log_probs, hidden) per node along its path
    for path in _paths(parents):
        state = model.prefill(ids[1:][None], torch.cat([hs[i][:-1] for i in AUX], -1)[None])
        for node in path:
            state = model.step(state, tokens[node].view(1))
        chain.append((torch.log_softmax(state.logits[0].float(), -1), state.hidden[0]))
    hidden = torch.stack([root.hidden[0] if p < 0 else chain[p][1] for p in parents.tolist()])
    out = proposer.expand(ctx, TreeNodes(tokens, parents, _depths(parents), hidden))
    torch.testing.assert_close(out.log_probs[0], root.log_probs[0])
    for i, (lp, h) in enumerate(chain):
        torch.testing.assert_close(out.log_probs[1 + i], lp, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out.hidden[1 + i], h, atol=1e-5, rtol=1e-5)


# ----------------------------------------------------------------------------- greedy: lossless


@pytest.mark.parametrize("top_k,depth,total", [(1, 3, 3), (2, 3, 6), (3, 4, 15)])
def test_greedy_lossless_hf_qwen3_random_eagle3(top_k: int, depth: int, total: int) -> None:
    target, head = hf_qwen3(seed=1)
    torch.manual_seed(0)
    proposer = FAMILY.proposer(FAMILY.build(Eagle3Config(aux_layer_ids=AUX, attn_backend="sdpa"), head), head.spec)
    prompt = torch.tensor([4, 9, 2, 11])
    res = tree_speculative_generate(target, proposer, prompt, top_k=top_k, depth=depth, total_tokens=total,
                                    max_new_tokens=16)
    assert torch.equal(res.token_ids, autoregressive_generate(target, prompt, 16))
    s = res.stats
    assert s.num_draft_tokens == total * s.num_drafts and len(s.accepted_per_pos) == depth
    assert s.num_accepted + s.num_drafts + 1 >= 16  # each round commits accepted + 1 after the prefill token


def test_greedy_oracle_tree_accepts_every_depth() -> None:
    target, _ = hf_qwen3(seed=2, peak=200.0)  # near one-hot: the greedy path outranks every other node
    prompt = torch.tensor([3, 1, 4, 1, 5])
    res = tree_speculative_generate(target, TargetTreeDrafter(target), prompt, top_k=2, depth=3, total_tokens=6,
                                    max_new_tokens=13)
    ref = autoregressive_generate(target, prompt, 13)
    assert torch.equal(res.token_ids, ref)
    assert res.stats.mean_acceptance_length == 4.0 and res.stats.per_position_acceptance == [1.0, 1.0, 1.0]
    eos = int(ref[6])  # stops at the first eos, exactly like plain decoding
    res = tree_speculative_generate(target, TargetTreeDrafter(target), prompt, top_k=2, depth=3, total_tokens=6,
                                    max_new_tokens=13, eos_token_id=eos)
    assert torch.equal(res.token_ids, autoregressive_generate(target, prompt, 13, eos_token_id=eos))


@pytest.fixture(scope="module")
def trained() -> Iterator[tuple[MaskedTinyTarget, Eagle3Proposer]]:
    """EAGLE-3 trained briefly (60 steps, 24 random sequences of 32 tokens) on a tiny target."""
    threads = torch.get_num_threads()
    torch._C.set_num_threads(1)
    target = MaskedTinyTarget(tiny_spec(), seed=3)
    g = torch.Generator().manual_seed(0)
    samples = []
    for _ in range(24):
        ids = torch.randint(0, 32, (32,), generator=g)
        samples.append(target.features(ids, AUX, torch.ones(32, dtype=torch.uint8)))
    torch.manual_seed(0)
    model = FAMILY.build(Eagle3Config(aux_layer_ids=AUX, ttt_steps=3, attn_backend="sdpa"), target.head())
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    batch = FAMILY.collate(samples)
    for _ in range(60):
        loss = FAMILY.objective(model, batch).loss()
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    torch._C.set_num_threads(threads)
    yield target, Eagle3Proposer(model)


PROMPTS = [torch.tensor([4, 9, 2, 11]), torch.tensor([30, 1, 17, 5]), torch.tensor([8, 8, 21, 3])]


def test_top_k_1_tree_is_the_chain(trained: tuple[MaskedTinyTarget, Eagle3Proposer]) -> None:
    target, proposer = trained
    for prompt in PROMPTS:
        chain = speculative_generate(target, proposer, prompt, num_speculative_tokens=4, max_new_tokens=32)
        tree = tree_speculative_generate(target, proposer, prompt, top_k=1, depth=4, total_tokens=4,
                                         max_new_tokens=32)
        assert torch.equal(tree.token_ids, chain.token_ids)
        assert tree.stats == chain.stats  # same rounds, same accepted counts per round position
        assert tree.stats.num_accepted > 0


def test_trained_eagle3_tree_accepts_more_than_chain(trained: tuple[MaskedTinyTarget, Eagle3Proposer]) -> None:
    target, proposer = trained
    chain, tree = AcceptanceStats(), AcceptanceStats()
    for prompt in PROMPTS:
        ref = autoregressive_generate(target, prompt, 32)
        c = speculative_generate(target, proposer, prompt, num_speculative_tokens=4, max_new_tokens=32)
        t = tree_speculative_generate(target, proposer, prompt, top_k=4, depth=4, total_tokens=20,
                                      max_new_tokens=32)
        assert torch.equal(t.token_ids, ref) and torch.equal(c.token_ids, ref)
        chain, tree = chain.merge(c.stats), tree.merge(t.stats)
    print(f"mean acceptance length: chain k=4 {chain.mean_acceptance_length:.3f}, "
          f"tree (4, 4, 20) {tree.mean_acceptance_length:.3f}; per depth {tree.per_position_acceptance}")
    assert tree.mean_acceptance_length > chain.mean_acceptance_length + 0.5
    g = torch.Generator().manual_seed(0)  # sampling mode runs end to end with the same drafter
    res = tree_speculative_generate(target, proposer, PROMPTS[0], top_k=4, depth=4, total_tokens=20,
                                    max_new_tokens=20, sampling=SamplingParams(temperature=0.7), generator=g)
    assert res.token_ids.numel() == 20 and res.stats.num_accepted > 0


# ----------------------------------------------------------------------------- sampling: lossless (statistical)


def _trigram(seed: int = 0) -> tuple[torch.Tensor, dict[tuple[int, ...], float]]:
    """3-token vocab; table [4, 3, 3] logits; the exact law of 3 tokens generated after [0, 1]."""
    table = torch.randn(4, 3, 3, generator=torch.Generator().manual_seed(seed))
    p = torch.softmax(table, -1).tolist()
    law = {x: p[0][1][x[0]] * p[1][x[0]][x[1]] * p[x[0]][x[1]][x[2]] for x in itertools.product(range(3), repeat=3)}
    return table, law


def _sample_law(table: torch.Tensor, n: int, seed: int) -> tuple[dict[tuple[int, ...], int], list[int]]:
    draft = torch.tensor([[0.6, 0.3, 0.1], [0.2, 0.2, 0.6], [0.45, 0.1, 0.45]])  # unrelated to the target
    counts: dict[tuple[int, ...], int] = {}
    lengths = [0, 0, 0]
    g = torch.Generator().manual_seed(seed)
    target = PrevTokenTarget(table)
    for _ in range(n):
        res = tree_speculative_generate(target, TableTreeDrafter(draft), torch.tensor([0, 1]), top_k=2, depth=2,
                                        total_tokens=4, max_new_tokens=3, sampling=SamplingParams(temperature=1.0),
                                        generator=g)
        key = tuple(res.token_ids.tolist())
        counts[key] = counts.get(key, 0) + 1
        lengths[res.stats.accepted_per_pos[0] + res.stats.accepted_per_pos[1]] += 1  # first round's path length
    return counts, lengths


def _chi_square(counts: dict[tuple[int, ...], int], law: dict[tuple[int, ...], float], n: int) -> float:
    return sum((counts.get(c, 0) - n * p) ** 2 / (n * p) for c, p in law.items())


CHI2_26_DOF_P001 = 54.05  # 27 cells, 26 degrees of freedom: P(chi2 > 54.05) = 0.001 under the null


def test_sampling_is_lossless_statistically() -> None:
    table, law = _trigram()
    n = 3000
    assert min(law.values()) * n > 5  # chi-square's expected-count rule (min 8.0)
    counts, lengths = _sample_law(table, n, seed=1)
    assert min(lengths) > 100  # rounds accepting 0, 1 and 2 nodes all occurred
    assert _chi_square(counts, law, n) < CHI2_26_DOF_P001  # observed 35.9 at seed 1 (mean 26 under the null)


def test_sampling_test_detects_wrong_residual_or_wrong_mask(monkeypatch: pytest.MonkeyPatch) -> None:
    """The same criterion rejects two broken decoders (observed chi2 393 and 145 at these n, seed 1)."""
    table, law = _trigram()
    with monkeypatch.context() as m:  # no residual after a rejection: the rejected token can come back
        m.setattr(verify, "recovered_distribution", lambda p, q, x: p)
        counts, _ = _sample_law(table, 1000, seed=1)
    assert _chi_square(counts, law, 1000) > CHI2_26_DOF_P001
    with monkeypatch.context() as m:  # a node that sees its earlier sibling
        m.setattr(spec_decode, "tree_attention_mask", _sibling_mask)
        counts, _ = _sample_law(table, 2000, seed=1)
    assert _chi_square(counts, law, 2000) > CHI2_26_DOF_P001
