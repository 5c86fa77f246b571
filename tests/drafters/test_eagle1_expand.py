"""EAGLE-1 `expand` (the TreeProposer protocol, drafters/common/tree.py): each node row equals
the chain drafter's prefill + steps along that node's path; a top_k = 1 tree is the chain."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from drafter_targets import tiny_spec
from test_tree_decode import _depths, _paths, _sibling_mask
from tree_targets import MaskedTinyTarget

import drafters.eagle1.proposer as eagle1_proposer
from drafters.common.contract import DraftContext, DrafterFamily
from drafters.common.tree import TreeNodes
from drafters.eagle1 import FAMILY, Eagle1Config, Eagle1Model
from drafters.eagle1.proposer import Eagle1Proposer
from drafters.spec_decode import (
    autoregressive_generate,
    speculative_generate,
    target_forward,
    tree_speculative_generate,
)

PARENTS = torch.tensor([-1, -1, 0, 1, 2, 2])  # two depth-1 nodes, a depth-3 node and its sibling
TOKENS = torch.tensor([7, 8, 1, 1, 30, 5])


def trained_eagle1(family: DrafterFamily, cfg: Eagle1Config, steps: int = 120
                   ) -> tuple[MaskedTinyTarget, Eagle1Model]:
    """An EAGLE-1 draft trained by `family` (eagle1 or eagle2) on a tiny target's own greedy
    continuations (12 sequences of 24 tokens); the loss must halve."""
    target = MaskedTinyTarget(tiny_spec(), seed=3)
    g = torch.Generator().manual_seed(11)
    samples = []
    for _ in range(12):
        prompt = torch.randint(0, 32, (4,), generator=g)
        ids = torch.cat([prompt, autoregressive_generate(target, prompt, 20)])
        mask = torch.ones(ids.numel(), dtype=torch.uint8)
        mask[:4] = 0
        s = target.features(ids, (1,), mask)
        s.pop("aux_hidden")
        samples.append(s)
    batch = family.collate(samples)
    torch.manual_seed(1)
    model = family.build(cfg, target.head()).train()
    assert isinstance(model, Eagle1Model)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    losses = []
    for _ in range(steps):
        loss = family.objective(model, batch).loss()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.5 * losses[0], losses[::20]
    return target, model.eval()


def _context(target: MaskedTinyTarget, ids: torch.Tensor) -> DraftContext:
    _, hs = target_forward(target, ids)
    return DraftContext(ids, tuple(h[:-1] for h in hs))


def _chain_along_paths(model: Eagle1Model, ctx: DraftContext) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(log_probs [V], predicted feature [H]) after prefill + one step per node of each path."""
    out = []
    for path in _paths(PARENTS):
        state = model.prefill(ctx.token_ids[1:][None], ctx.target_hidden_states[-1][None])
        for node in path:
            state = model.step(state, TOKENS[node].view(1))
        out.append((torch.log_softmax(state.logits[0].float(), -1), state.feature[0]))
    return out


def _nodes(root_hidden: torch.Tensor, chain: list[tuple[torch.Tensor, torch.Tensor]]) -> TreeNodes:
    hidden = torch.stack([root_hidden if p < 0 else chain[p][1] for p in PARENTS.tolist()])
    return TreeNodes(TOKENS, PARENTS, _depths(PARENTS), hidden)


def test_expand_equals_chain_along_each_path(monkeypatch: pytest.MonkeyPatch) -> None:
    target = MaskedTinyTarget(tiny_spec(), seed=3)
    torch.manual_seed(0)
    model = FAMILY.build(Eagle1Config(attn_backend="sdpa"), target.head()).eval()
    proposer = Eagle1Proposer(model)
    ctx = _context(target, torch.tensor([4, 9, 2, 11, 6]))
    root = proposer.expand(ctx, TreeNodes.root_only())
    prefill = model.prefill(ctx.token_ids[1:][None], ctx.target_hidden_states[-1][None])
    torch.testing.assert_close(root.hidden[0], prefill.feature[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(root.log_probs[0], torch.log_softmax(prefill.logits[0].float(), -1),
                               atol=1e-5, rtol=1e-5)
    chain = _chain_along_paths(model, ctx)
    out = proposer.expand(ctx, _nodes(root.hidden[0], chain))
    assert tuple(out.log_probs.shape) == (1 + PARENTS.numel(), 32) and tuple(out.hidden.shape) == (7, 16)
    torch.testing.assert_close(out.log_probs[0], root.log_probs[0], atol=1e-5, rtol=1e-5)
    for i, (lp, h) in enumerate(chain):
        torch.testing.assert_close(out.log_probs[1 + i], lp, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(out.hidden[1 + i], h, atol=1e-5, rtol=1e-5)
    # the check can fail: the root's feature fed to every node, or a node that sees its sibling
    wrong = proposer.expand(ctx, TreeNodes(TOKENS, PARENTS, _depths(PARENTS), root.hidden[0].expand(6, -1)))
    assert (wrong.hidden[1 + 4] - chain[4][1]).abs().max() > 1e-3
    monkeypatch.setattr(eagle1_proposer, "tree_attention_mask", _sibling_mask)
    seen = proposer.expand(ctx, _nodes(root.hidden[0], chain))
    assert (seen.hidden[1 + 5] - chain[5][1]).abs().max() > 1e-3  # node 5 sees its earlier sibling 4


def test_expand_refuses_a_context_without_features() -> None:
    target = MaskedTinyTarget(tiny_spec(), seed=3)
    proposer = Eagle1Proposer(FAMILY.build(Eagle1Config(attn_backend="sdpa"), target.head()))
    ctx = _context(target, torch.tensor([4, 9, 2]))
    with pytest.raises(ValueError, match=r"2 positions, expected 3"):
        proposer.expand(DraftContext(torch.tensor([4, 9, 2, 5]), ctx.target_hidden_states), TreeNodes.root_only())
    with pytest.raises(ValueError, match=">= 2 committed"):
        proposer.expand(DraftContext(torch.tensor([4]), ()), TreeNodes.root_only())


@pytest.fixture(scope="module")
def trained() -> Iterator[tuple[MaskedTinyTarget, Eagle1Proposer]]:
    threads = torch.get_num_threads()
    torch._C.set_num_threads(1)
    target, model = trained_eagle1(FAMILY, Eagle1Config(attn_backend="sdpa"))
    torch._C.set_num_threads(threads)
    yield target, Eagle1Proposer(model)


def test_top_k_1_tree_is_the_chain(trained: tuple[MaskedTinyTarget, Eagle1Proposer]) -> None:
    target, proposer = trained
    accepted = 0
    for prompt in (torch.tensor([4, 9, 2, 11]), torch.tensor([30, 1, 17, 5]), torch.tensor([8, 8, 21, 3])):
        chain = speculative_generate(target, proposer, prompt, num_speculative_tokens=4, max_new_tokens=24)
        tree = tree_speculative_generate(target, proposer, prompt, top_k=1, depth=4, total_tokens=4,
                                         max_new_tokens=24)
        assert torch.equal(tree.token_ids, chain.token_ids)
        assert tree.stats == chain.stats  # same rounds, same accepted counts per position
        accepted += tree.stats.num_accepted
    assert accepted > 12, accepted  # observed 44: the draft is informative, so the equality says something
