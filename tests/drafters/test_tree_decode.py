"""EAGLE-2 dynamic-tree decoding: golden masks/positions, expand + rerank by hand, tree pass ==
path-by-path causal pass (HF Qwen3), greedy and sampling losslessness, chain equivalence."""

from __future__ import annotations

import pytest
import torch
from drafter_targets import tiny_spec
from tree_targets import MaskedTinyTarget, TableTreeDrafter, hf_qwen3

from drafters.common.contract import DraftContext
from drafters.common.metrics import AcceptanceStats
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
    target_forward,
    target_tree_forward,
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
