"""Acceptance metrics in vLLM's convention (v1/spec_decode/metrics.py: mean acceptance length =
1 + num_accepted / num_drafts; per-position rate i = accepted_per_pos[i] / num_drafts; a tree round
counts its accepted path), and the training-time simulation of acceptance length."""

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
        """One round: `num_proposed` draft tokens, the first `num_accepted` accepted; a tree passes
        its depth as num_positions and the accepted path length as num_accepted."""
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
    """Training-time estimate of vLLM's mean acceptance length: step_correct, step_valid bool [S, ...]; a
    row with a valid step 0 counts 1 + its leading valid-and-correct steps. Returns (sum, rows), floats."""
    if step_correct.shape != step_valid.shape:
        raise ValueError(f"step_correct {tuple(step_correct.shape)} vs step_valid {tuple(step_valid.shape)}")
    k = step_correct.shape[0] if num_speculative_tokens is None else min(num_speculative_tokens, step_correct.shape[0])
    ok = (step_correct.to(torch.bool) & step_valid.to(torch.bool))[:k]
    leading = torch.cumprod(ok.to(torch.int64), dim=0).sum(0)  # [...]
    rows = step_valid[0].to(torch.bool)
    return (1 + leading[rows]).sum().float(), rows.sum().float()


def reachable_chain_counts(draftable: list[bool], k: int) -> tuple[int, int]:
    """(accepted draft tokens, drafts) of a greedy k-chain decode of a known response by the best draft
    that cannot propose tokens not `draftable` past the first draft position: an upper bound."""
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
    """Diagnostics of a block drafter's loss rows as (sum, count) pairs: acc, top5, valid_tokens and per
    position j acc_pos{j} / loss_pos{j}; top int64 [N, k], labels, draft_pos (1-based), row_loss [N]."""
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
    """Generated tokens per target forward, G / (G - A): fair to methods that sometimes draft nothing
    (n-gram), which mean acceptance length (dividing by drafted rounds only) flatters."""
    if requests < 1 or generated_tokens < requests or not 0 <= accepted_tokens <= generated_tokens - requests:
        raise ValueError(f"tokens_per_target_forward: got generated_tokens={generated_tokens}, "
                         f"accepted_tokens={accepted_tokens}, requests={requests}; expected requests >= 1, "
                         "generated >= requests and 0 <= accepted <= generated - requests")
    return generated_tokens / (generated_tokens - accepted_tokens)


def prompt_bootstrap_interval(generated: list[int], accepted: list[int], level: float = 0.9,
                              resamples: int = 2000, seed: int = 0) -> tuple[float, float]:
    """Seeded percentile bootstrap over prompts of the pooled tokens per target forward
    (G / (G - A), as `tokens_per_target_forward`); returns the (1 -/+ level) / 2 quantiles."""
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
    """Expected tokens a request gains per verification step drafting k chain tokens: 1 (bonus) plus
    the first k of vLLM's per-position rates (each already P(positions 0..i all accepted))."""
    if k < 0 or k > len(per_position):
        raise ValueError(f"k: got {k}, expected 0..{len(per_position)} (positions with a measured acceptance)")
    rates = [float(r) for r in per_position[:k]]
    if any(not 0.0 <= r <= 1.0 for r in rates) or any(b > a + 1e-12 for a, b in zip(rates, rates[1:])):
        raise ValueError(f"per_position: got {per_position}, expected non-increasing rates in [0, 1]")
    return 1.0 + sum(rates)
