"""Acceptance metrics in vLLM's convention (v1/spec_decode/metrics.py), and the training-time
simulation of acceptance length from TTT step predictions.

vLLM counters: num_drafts (verification rounds), num_draft_tokens (draft tokens proposed),
num_accepted_tokens, num_accepted_tokens_per_pos[i] (rounds whose draft token i was accepted).

- mean acceptance length = 1 + num_accepted / num_drafts (the bonus / recovered token counts)
- per-position acceptance rate i = accepted_per_pos[i] / num_drafts
- draft acceptance rate = num_accepted / num_draft_tokens

Worked example: 2 rounds with k = 3; round 1 accepts 3 (all), round 2 accepts 1 ->
accepted 4, per_pos [2, 1, 1], mean acceptance length 1 + 4/2 = 3.0, rate 4/6.

Trees (EAGLE-2, drafters/common/tree.py), the same counters: a round (one draft) proposes a tree
of N nodes (num_draft_tokens += N) and accepts one root-to-node path of L nodes (num_accepted
+= L); accepted_per_pos[d] counts the rounds whose accepted path reached depth d + 1, with one
entry per tree depth (`record(N, L, num_positions=depth)`). Mean acceptance length is still
1 + accepted / num_drafts; the draft acceptance rate accepted / N is low by construction (a tree
spends N nodes on one path). Worked example: depth 3, 8 nodes; rounds accept paths of 3 and 0
nodes -> accepted 3, per_pos [1, 1, 1], mean acceptance length 1 + 3/2 = 2.5, rate 3/16.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass
class AcceptanceStats:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def record(self, num_proposed: int, num_accepted: int, num_positions: int | None = None) -> None:
        """One verification round: `num_proposed` draft tokens, the first `num_accepted` accepted.

        num_positions: positions a draft can reach (default num_proposed: a chain); a tree passes
        its depth, and num_accepted is then the length of the accepted root-to-node path.
        """
        positions = num_proposed if num_positions is None else num_positions
        if not 0 <= num_accepted <= min(num_proposed, positions):
            raise ValueError(f"num_accepted: got {num_accepted}, expected 0..{min(num_proposed, positions)}")
        self.num_drafts += 1
        self.num_draft_tokens += num_proposed
        self.num_accepted += num_accepted
        if len(self.accepted_per_pos) < positions:
            self.accepted_per_pos.extend([0] * (positions - len(self.accepted_per_pos)))
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1

    def merge(self, other: AcceptanceStats) -> AcceptanceStats:
        n = max(len(self.accepted_per_pos), len(other.accepted_per_pos))
        pad = [0] * n
        per_pos = [a + b for a, b in zip((self.accepted_per_pos + pad)[:n], (other.accepted_per_pos + pad)[:n])]
        return AcceptanceStats(self.num_drafts + other.num_drafts, self.num_draft_tokens + other.num_draft_tokens,
                               self.num_accepted + other.num_accepted, per_pos)

    @property
    def mean_acceptance_length(self) -> float:
        return 1.0 + self.num_accepted / self.num_drafts if self.num_drafts else float("nan")

    @property
    def per_position_acceptance(self) -> list[float]:
        return [a / self.num_drafts for a in self.accepted_per_pos] if self.num_drafts else []

    @property
    def draft_acceptance_rate(self) -> float:
        return self.num_accepted / self.num_draft_tokens if self.num_draft_tokens else float("nan")


def simulated_acceptance_length(step_correct: Tensor, step_valid: Tensor,
                                num_speculative_tokens: int | None = None) -> tuple[Tensor, Tensor]:
    """Training-time estimate of vLLM's mean acceptance length from TTT predictions.

    step_correct, step_valid: bool [S, ...]: at TTT step j and row r, whether the draft argmax
    equals the target argmax, and whether that (step, row) is a real, loss-bearing prediction.
    A row counts if step 0 is valid; its length is 1 + the number of leading steps that are valid
    and correct, with at most `num_speculative_tokens` (default S) steps.
    Returns (sum of lengths, number of rows), float scalars, so ranks can all-reduce both.

    Worked example, S = 3, 3 rows, all valid, step_correct = [[1,1,0],[1,0,1],[1,1,1]] (row r is
    column r: r0 = (1,1,1), r1 = (1,0,1), r2 = (0,1,1)) -> leading runs 3, 1, 0 -> lengths 4, 2, 1
    -> returns (7, 3).
    """
    if step_correct.shape != step_valid.shape:
        raise ValueError(f"step_correct {tuple(step_correct.shape)} vs step_valid {tuple(step_valid.shape)}")
    k = step_correct.shape[0] if num_speculative_tokens is None else min(num_speculative_tokens, step_correct.shape[0])
    ok = (step_correct.to(torch.bool) & step_valid.to(torch.bool))[:k]
    leading = torch.cumprod(ok.to(torch.int64), dim=0).sum(0)  # [...]
    rows = step_valid[0].to(torch.bool)
    return (1 + leading[rows]).sum().float(), rows.sum().float()


def reachable_chain_counts(draftable: list[bool], k: int) -> tuple[int, int]:
    """(accepted draft tokens, drafts) of vLLM's counters for the greedy chain decode (k drafts a forward) of one
    response whose target tokens are known, by the best draft that cannot propose the tokens marked
    not `draftable` deeper than the first draft position: at position 1 it proposes the target's own token
    (it reads the target's features of that very step), at positions 2..k the target's token where
    `draftable`, else something the target rejects.

    draftable[i] for response token i (its last entry the end-of-sequence token when the response has one).
    Token 0 comes from the prefill, which drafts nothing; each forward then checks k drafts from token i,
    accepts the leading run (never past the response's end) and adds one token of its own unless the run
    reached the end. Worked example, k = 3, "7 + 4 = 11<eos>" as [7, ' +', ' ', 4, ' =', ' ', 1, 1, <eos>]
    with the two digits of the sum not draftable:
        forward 1 from token 1: ' +', ' ', 4 accepted (3), then ' =' -> next token 5
        forward 2 from token 5: ' ' accepted, 1 (depth 2) rejected (1), then 1 -> next token 7
        forward 3 from token 7: 1 (depth 1), <eos> accepted (2), the end -> (6, 3)
    so no such draft makes more than 1 + 6 / 3 = 3.0 tokens per target forward on this response."""
    if k < 1:
        raise ValueError(f"k: got {k}, expected >= 1")
    accepted = drafts = 0
    i, n = 1, len(draftable)
    while i < n:
        run = 0
        while run < min(k, n - i) and (run == 0 or draftable[i + run]):
            run += 1
        accepted += run
        drafts += 1
        i += run + 1
    return accepted, drafts


TOP_K = 5  # block_row_metrics' top-k accuracy


def block_row_metrics(top: Tensor, labels: Tensor, draft_pos: Tensor, row_loss: Tensor,
                      num_positions: int) -> dict[str, tuple[Tensor, Tensor]]:
    """Diagnostics of a block drafter's loss rows, as (sum, count) pairs (DFlash, DSpark, Domino).

    top int64 [N, k] (the rows' top ids, best first: common/chunked_head.topk_ids(logits, TOP_K)),
    labels int64 [N], draft_pos int64 [N] (1-based: the row drafts token j of its block), row_loss
    [N] (the row's unweighted loss). Returns acc (top-1), top5 (top-k), valid_tokens (count 1), and
    per position j = 1..num_positions: acc_pos{j} and loss_pos{j} (mean row loss).
    Worked example: top-1 ids (3, 1), labels (3, 2), draft_pos (1, 2), row_loss (0.5, 2.0)
    -> acc (1, 2), acc_pos1 (1, 1), acc_pos2 (0, 1), loss_pos2 (2.0, 1).
    """
    with torch.no_grad():
        n = torch.tensor(float(labels.numel()), device=labels.device)
        hit1 = (top[:, 0] == labels).float()
        hit5 = (top == labels[:, None]).any(-1).float()
        loss = row_loss.detach().float()
        out: dict[str, tuple[Tensor, Tensor]] = {
            "acc": (hit1.sum(), n), "top5": (hit5.sum(), n), "valid_tokens": (n, torch.ones_like(n))}
        for j in range(1, num_positions + 1):
            at = draft_pos == j
            cnt = at.sum().float()
            out[f"acc_pos{j}"] = (hit1[at].sum(), cnt)
            out[f"loss_pos{j}"] = (torch.where(at, loss, torch.zeros_like(loss)).sum(), cnt)
        return out


def tokens_per_target_forward(generated_tokens: int, accepted_tokens: int, requests: int = 1) -> float:
    """Generated tokens per target forward, fair to methods that sometimes draft nothing (n-gram).

    Each request's prefill forward yields its first token; every later target forward yields one
    token plus the draft tokens it accepted, whether or not a draft was proposed. So over
    `requests` requests generating G tokens with A accepted draft tokens, the target ran
    G - A forwards (prefills included). Mean acceptance length (1 + A / drafts) instead divides by
    drafted rounds only, flattering a method that skips rounds.

    Worked example: 2 requests, 10 tokens each (G = 20), 8 drafts accepted in all (A = 8):
    2 prefills + 10 decode forwards = 12 = G - A, i.e. 20 / 12 = 1.667 tokens per target forward.
    """
    if requests < 1 or generated_tokens < requests or not 0 <= accepted_tokens <= generated_tokens - requests:
        raise ValueError(f"tokens_per_target_forward: got generated_tokens={generated_tokens}, "
                         f"accepted_tokens={accepted_tokens}, requests={requests}; expected requests >= 1, "
                         "generated >= requests and 0 <= accepted <= generated - requests")
    return generated_tokens / (generated_tokens - accepted_tokens)


def prompt_bootstrap_interval(generated: list[int], accepted: list[int], level: float = 0.9,
                              resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """How far the pooled generated tokens per target forward could move with other prompts: a percentile
    bootstrap over prompts, seeded, so the same figures give the same interval on any machine.

    `generated[i]` / `accepted[i]`: prompt i's generated tokens and accepted draft tokens. Each resample
    draws len(generated) prompts with replacement and pools them, G / (G - A) as in
    `tokens_per_target_forward`; the interval is the resamples' (1 - level) / 2 and (1 + level) / 2
    quantiles (the lower one rounded down, the upper one up, to resample values).
    Worked example: two prompts, 10 tokens with 5 accepted (2.0) and 10 with 0 (1.0). A resample holds
    both copies of the first (2.0) with probability 1/4, one of each (20 / 15 = 1.333) with 1/2, both of
    the second (1.0) with 1/4; so the 90% interval is (1.0, 2.0).
    """
    n = len(generated)
    if n < 2 or len(accepted) != n:
        raise ValueError(f"prompt_bootstrap_interval: got {n} generated and {len(accepted)} accepted counts; "
                         "expected the same number, at least 2")
    if not 0 < level < 1 or resamples < 1:
        raise ValueError(f"prompt_bootstrap_interval: got level={level}, resamples={resamples}; expected "
                         "0 < level < 1 and resamples >= 1")
    for i, (g, a) in enumerate(zip(generated, accepted, strict=True)):
        if g < 1 or not 0 <= a <= g - 1:
            raise ValueError(f"prompt_bootstrap_interval: prompt {i} has generated={g}, accepted={a}; "
                             "expected generated >= 1 and 0 <= accepted <= generated - 1")
    draws = torch.randint(n, (resamples, n), generator=torch.Generator().manual_seed(seed))  # [R, n]
    g_sum = torch.tensor(generated)[draws].sum(1).tolist()  # [R] pooled generated tokens
    a_sum = torch.tensor(accepted)[draws].sum(1).tolist()  # [R] pooled accepted tokens
    ratios = torch.tensor([tokens_per_target_forward(g, a, n) for g, a in zip(g_sum, a_sum, strict=True)],
                          dtype=torch.float64)
    low = torch.quantile(ratios, (1 - level) / 2, interpolation="lower")
    high = torch.quantile(ratios, (1 + level) / 2, interpolation="higher")
    return float(low), float(high)


def expected_tokens_per_step(per_position: list[float], k: int) -> float:
    """Expected tokens a request gains per verification step when it drafts k tokens of a chain whose
    per-position acceptance rates (vLLM's `accepted_per_pos[i] / num_drafts`, each already the chance
    that positions 0..i were all accepted) are `per_position`: 1 (the bonus or recovered token) plus
    the first k rates. k = 0 is plain decoding (1.0).

    Worked example: rates [0.8, 0.6, 0.3], k = 2 -> 1 + 0.8 + 0.6 = 2.4; k = 3 -> 2.7.
    """
    if k < 0 or k > len(per_position):
        raise ValueError(f"k: got {k}, expected 0..{len(per_position)} (positions with a measured acceptance)")
    rates = [float(r) for r in per_position[:k]]
    if any(not 0.0 <= r <= 1.0 for r in rates) or any(b > a + 1e-12 for a, b in zip(rates, rates[1:])):
        raise ValueError(f"per_position: got {per_position}, expected non-increasing rates in [0, 1]")
    return 1.0 + sum(rates)
