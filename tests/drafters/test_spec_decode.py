"""Reference speculative decoder: losslessness (greedy exact, sampling statistical) and stats."""

from __future__ import annotations

import itertools

import pytest
import torch
from drafter_targets import BigramTarget, TinyTarget, tiny_spec

from drafters import get_family
from drafters.common.contract import DraftContext, Proposal
from drafters.common.sampling import ChainDraws, SamplingParams, logits_to_probs, sample
from drafters.eagle3 import Eagle3Config
from drafters.spec_decode import autoregressive_generate, speculative_generate
from drafters.verify import recovered_distribution, verify_greedy


class TargetAsDrafter:
    """Proposes with the target itself (autoregressive, same sampling): must be fully accepted."""

    def __init__(self, target: torch.nn.Module):
        self.target = target

    def propose(self, ctx: DraftContext, num_tokens: int, sampling: SamplingParams,
                generator: torch.Generator | None = None) -> Proposal:
        seq, tokens, probs = ctx.token_ids.clone(), [], []
        for _ in range(num_tokens):
            p = logits_to_probs(self.target(input_ids=seq[None]).logits[0, -1], sampling)
            tok = p.argmax() if sampling.greedy else sample(p, generator)
            tokens.append(tok)
            probs.append(p)
            seq = torch.cat([seq, tok.view(1)])
        return Proposal(torch.stack(tokens), None if sampling.greedy else torch.stack(probs))


class BadDrafter:
    """Greedy: always proposes `token` (q one-hot). Probabilistic: samples a fixed bad q."""

    def __init__(self, q: torch.Tensor, token: int):
        self.q, self.token = q, token

    def propose(self, ctx: DraftContext, num_tokens: int, sampling: SamplingParams,
                generator: torch.Generator | None = None) -> Proposal:
        if sampling.greedy:
            return Proposal(torch.full((num_tokens,), self.token), None)
        q = self.q.expand(num_tokens, -1)
        return Proposal(sample(q, generator), q.clone())


def test_self_drafting_accepts_everything() -> None:
    target = TinyTarget(tiny_spec(), seed=2)
    prompt = torch.tensor([1, 7, 3])
    res = speculative_generate(target, TargetAsDrafter(target), prompt, num_speculative_tokens=3, max_new_tokens=13)
    assert res.stats.num_accepted == res.stats.num_draft_tokens == 3 * res.stats.num_drafts
    assert res.stats.mean_acceptance_length == 4.0 and res.stats.per_position_acceptance == [1.0, 1.0, 1.0]
    assert torch.equal(res.token_ids, autoregressive_generate(target, prompt, 13))
    g = torch.Generator().manual_seed(0)  # sampling with q == p: accept probability min(1, p/q) = 1
    res = speculative_generate(target, TargetAsDrafter(target), prompt, num_speculative_tokens=2, max_new_tokens=9,
                               sampling=SamplingParams(temperature=0.8), draft_sampling="probabilistic", generator=g)
    assert res.stats.num_accepted == res.stats.num_draft_tokens and res.token_ids.numel() == 9


def test_eagle3_proposer_greedy_is_lossless() -> None:
    target = TinyTarget(tiny_spec(), seed=3)
    family = get_family("eagle3")
    torch.manual_seed(0)
    draft = family.build(Eagle3Config(aux_layer_ids=(1, 2, 3)), target.head())
    proposer = family.proposer(draft, target.spec)
    prompt = torch.tensor([4, 9, 2, 11])
    res = speculative_generate(target, proposer, prompt, num_speculative_tokens=4, max_new_tokens=16, eos_token_id=None)
    assert torch.equal(res.token_ids, autoregressive_generate(target, prompt, 16))
    s = res.stats
    # every round emits accepted + 1 tokens after the prefill token (the last round may overshoot)
    assert s.num_accepted + s.num_drafts + 1 >= 16 and s.num_draft_tokens == 4 * s.num_drafts
    assert s.accepted_per_pos == sorted(s.accepted_per_pos, reverse=True)


def test_greedy_verification_and_eos() -> None:
    logits = torch.tensor([[0.0, 5.0, 0.0], [0.0, 0.0, 5.0], [5.0, 0.0, 0.0]])  # argmax 1, 2, 0
    assert verify_greedy(torch.tensor([1, 2]), logits) == (2, 0)  # all accepted + bonus
    assert verify_greedy(torch.tensor([1, 0]), logits) == (1, 2)  # mismatch at 1: emit target argmax 2
    assert verify_greedy(torch.tensor([0, 2]), logits) == (0, 1)
    table = torch.tensor([[0.0, 9.0, 0.0], [0.0, 0.0, 9.0], [9.0, 0.0, 0.0]])  # 0 -> 1 -> 2 -> 0
    out = speculative_generate(BigramTarget(table), BadDrafter(torch.ones(3) / 3, 1), torch.tensor([0]),
                               num_speculative_tokens=3, max_new_tokens=10, eos_token_id=2)
    assert out.token_ids.tolist() == [1, 2]


def test_recovered_distribution() -> None:
    p = torch.tensor([0.5, 0.3, 0.2])
    torch.testing.assert_close(recovered_distribution(p, None, 0), torch.tensor([0.0, 0.6, 0.4]))
    q = torch.tensor([0.2, 0.6, 0.2])
    torch.testing.assert_close(recovered_distribution(p, q, 1), torch.tensor([1.0, 0.0, 0.0]))


def test_sampling_params_by_hand() -> None:
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    e = torch.exp(logits / 0.5)
    torch.testing.assert_close(logits_to_probs(logits, SamplingParams(temperature=0.5)), e / e.sum())
    top2 = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    torch.testing.assert_close(top2, torch.tensor([1.0, torch.e ** -1, 0.0, 0.0]) / (1 + torch.e ** -1))
    p = torch.softmax(logits, -1)  # [0.644, 0.237, 0.087, 0.032]: top_p 0.7 keeps the first two
    torch.testing.assert_close(logits_to_probs(logits, SamplingParams(1.0, top_p=0.7)),
                               torch.tensor([p[0], p[1], 0.0, 0.0]) / (p[0] + p[1]))
    assert logits_to_probs(logits, SamplingParams()).tolist() == [1.0, 0.0, 0.0, 0.0]



def test_chain_draws_by_hand() -> None:
    # greedy: the argmax, the lowest id on a tie, and no distributions
    greedy = ChainDraws(SamplingParams())
    assert greedy.draw(torch.tensor([0.0, 3.0, 3.0])).item() == 1
    assert greedy.draw(torch.tensor([5.0, 1.0, 0.0], dtype=torch.bfloat16)).item() == 0
    tokens, probs = greedy.stacked()
    assert tokens.tolist() == [1, 0] and tokens.dtype == torch.int64 and probs is None
    # sampling: the same draws as logits_to_probs + sample on the same generator, and the q of each
    sampling = SamplingParams(temperature=0.7, top_k=2)
    rows = torch.tensor([[2.0, 1.0, 0.0], [0.0, 0.5, 1.0], [1.0, 1.0, -3.0]])
    draws = ChainDraws(sampling, torch.Generator().manual_seed(7))
    drawn = [draws.draw(row).item() for row in rows]
    g = torch.Generator().manual_seed(7)
    expected = [int(sample(logits_to_probs(row, sampling), g)) for row in rows]
    tokens, probs = draws.stacked()
    assert drawn == expected == tokens.tolist()
    assert probs is not None and probs.shape == (3, 3)
    torch.testing.assert_close(probs, logits_to_probs(rows, sampling))
    assert probs[:, [2, 0, 2]].diagonal().eq(0).all()  # top-2 drops each row's smallest logit

def _chi_square(counts: dict[tuple[int, ...], int], probs: dict[tuple[int, ...], float], n: int) -> float:
    return sum((counts.get(c, 0) - n * p) ** 2 / (n * p) for c, p in probs.items())


@pytest.mark.parametrize("draft_sampling", ["greedy", "probabilistic"])
def test_sampling_is_lossless_with_a_bad_drafter(draft_sampling: str) -> None:
    # bigram target over 3 tokens; exact law of 3 generated tokens after prompt [0]
    table = torch.log(torch.tensor([[0.2, 0.5, 0.3], [0.6, 0.15, 0.25], [0.3, 0.3, 0.4]]))
    prob = table.exp().tolist()
    exact = {c: prob[0][c[0]] * prob[c[0]][c[1]] * prob[c[1]][c[2]] for c in itertools.product(range(3), repeat=3)}
    drafter = BadDrafter(torch.tensor([0.05, 0.05, 0.9]), token=2)  # prefers the target's least likely tokens
    g = torch.Generator().manual_seed(1234)
    n, counts, accepted = 2000, dict[tuple[int, ...], int](), 0
    for _ in range(n):
        res = speculative_generate(BigramTarget(table), drafter, torch.tensor([0]), num_speculative_tokens=2,
                                   max_new_tokens=3, sampling=SamplingParams(temperature=1.0),
                                   draft_sampling=draft_sampling, generator=g)  # type: ignore[arg-type]
        key = tuple(res.token_ids.tolist())
        counts[key] = counts.get(key, 0) + 1
        accepted += res.stats.num_accepted
    assert 0 < accepted < 2 * n  # both acceptance and rejection paths ran
    # 26 degrees of freedom: P(chi2 > 54.05) = 0.001
    assert _chi_square(counts, exact, n) < 54.05
    # power check: the law of "always accept the draft" is far from what was sampled
    q = drafter.q.tolist()
    wrong = {c: prob[0][c[0]] * q[c[1]] * q[c[2]] for c in exact}
    assert _chi_square(counts, wrong, n) > 500
