"""DFlash block drafting for the reference decoder, as vLLM's `DFlashProposer` does it (docs/design/engines.md
section 2.4): ONE forward over [x_n, MASK x K] at positions n..n + K over the context at 0..n-1; slot k
gives d_k (n = 4, K = 3: [x_4, M, M, M] at 4..7 sees rows 0..3, slots 1..3 give d_1..d_3)."""

from __future__ import annotations

from typing import Generic, TypeVar

import torch

from drafters.common.contract import DraftContext, Proposal
from drafters.common.sampling import SamplingParams
from drafters.dflash.model import DFlashDraft

M = TypeVar("M", bound=DFlashDraft)


def block_hidden(model: DFlashDraft, ctx: DraftContext, hidden_state_ids: tuple[int, ...], rows: int) -> torch.Tensor:
    """ONE backbone forward: [x_n, MASK x (rows - 1)] at positions n.. over the context features at
    0..n-1 -> post-norm hidden [rows, H] (shared by the DFlash, DSpark and Domino proposers)."""
    features = ctx.features(hidden_state_ids)  # [n, m*H_t]
    ids, n = ctx.token_ids, features.shape[0]
    device = model.fc.weight.device
    assert model.cfg.mask_token_id is not None
    block = torch.full((1, 1, rows), model.cfg.mask_token_id, dtype=torch.long, device=device)
    block[0, 0, 0] = ids[-1]
    anchors = torch.full((1, 1), n, dtype=torch.long, device=device)
    valid = torch.ones(1, 1, dtype=torch.bool, device=device)
    return model.block_hidden(features.to(device)[None], block, anchors, valid)[0, 0]  # [rows, H]


class BlockProposer(Generic[M]):
    """What the DFlash, DSpark and Domino proposers share; a block of B rows drafts at most
    B - `anchor_rows` tokens (1 for DFlash and Domino, whose anchor slot drafts nothing; 0 for DSpark)."""

    anchor_rows = 1

    def __init__(self, model: M):
        self.model = model
        self.hidden_state_ids = model.cfg.hidden_state_ids(model.spec)

    def round_hidden(self, ctx: DraftContext, num_tokens: int, rows: int) -> torch.Tensor:
        """`block_hidden` of `rows` rows [rows, H] for a round drafting `num_tokens`; ValueError when
        one block cannot draft that many."""
        most = self.model.cfg.block_size - self.anchor_rows
        if not 1 <= num_tokens <= most:
            bound = "block_size - 1" if self.anchor_rows else "block_size"
            raise ValueError(f"propose: need 1 <= num_tokens <= {bound} = {most}; got num_tokens={num_tokens}")
        return block_hidden(self.model, ctx, self.hidden_state_ids, rows)


class DFlashProposer(BlockProposer[DFlashDraft]):
    def block_logits(self, ctx: DraftContext, num_tokens: int) -> torch.Tensor:
        """float32 [num_tokens, V]: the logits of slots 1..num_tokens of the block [x_n, MASK x K]."""
        hidden = self.round_hidden(ctx, num_tokens, num_tokens + 1)  # [K + 1, H]
        return self.model.logits(hidden[1:]).float()  # [K, V]

    @torch.no_grad()
    def propose(self, ctx: DraftContext, num_tokens: int, sampling: SamplingParams,
                generator: torch.Generator | None = None) -> Proposal:
        return Proposal.drawn(self.block_logits(ctx, num_tokens), sampling, generator)  # one independent draw per slot
