"""Our Domino proposer drafts exactly what SGLang's own Domino rollout drafts from the same model.

SGLang serves Domino on CUDA only, but its rollout, `domino_greedy_rollout`
(sglang 0.5.23 `srt/speculative/domino_utils.py`, torch-only), runs here unchanged
(tests/engines/sglang_ref.py). Given the draft's post-norm block hidden states for [x_n, MASK x
(B - 1)], the bonus token x_n, the target embedding and lm_head, and the exported `prefix_gru` and
`embed_proj` (loaded from our export, so the tensor names and layouts are checked too), it must
propose the same B - 1 tokens as `DominoProposer` on a non-degenerate random target (non-unit norms,
a correction head large enough to change the base argmax, which the test checks). Planted fault:
the same rollout with `shift_label=False` (reading the DFlash slots 1..B-1 instead of 0..B-2)
disagrees, so a label-shift bug in our layout would be seen.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from drafters.common.blocks import block_input_ids
from drafters.common.contract import DraftContext
from drafters.common.sampling import SamplingParams
from drafters.common.target import TargetHead, TargetSpec
from drafters.domino import FAMILY
from drafters.domino.config import DominoConfig

from .sglang_ref import load_module

SPEC = TargetSpec(vocab_size=40, hidden_size=24, num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=6, intermediate_size=48, rope_theta=10000.0, rms_norm_eps=1e-6, max_position_embeddings=256,
                  model_type="qwen3", tie_word_embeddings=False)
BS = 5  # 4 drafts per block


def _target() -> TargetHead:
    g = torch.Generator().manual_seed(11)
    embed, lm = torch.randn(40, 24, generator=g), torch.randn(40, 24, generator=g) * 0.5
    return TargetHead(SPEC, embed, lm, 0.5 + torch.rand(24, generator=g))


def _contexts(n: int) -> list[DraftContext]:
    g = torch.Generator().manual_seed(3)
    out = []
    for length in range(6, 6 + n):
        ids = torch.randint(0, 39, (length + 1,), generator=g)
        states = tuple(torch.randn(length, 24, generator=g) for _ in range(SPEC.num_hidden_layers + 1))
        out.append(DraftContext(token_ids=ids, target_hidden_states=states))
    return out


def test_domino_proposer_equals_sglangs_rollout(tmp_path: Path) -> None:
    domino = load_module("srt/speculative/domino_utils.py")
    head = _target()
    cfg = FAMILY.resolve(DominoConfig(num_layers=2, block_size=BS, num_target_features=2, target_layer_ids=(1, 3),
                                      mask_token_id=39, gru_hidden_dim=12, emb_dim=10, attn_backend="sdpa"), SPEC)
    torch.manual_seed(0)
    model = FAMILY.build(cfg, head)
    with torch.no_grad():
        model.embed_proj[2].weight.normal_(0.0, 2.0)  # corrections that move the argmax
    model = FAMILY.load_export(FAMILY.export(model.eval(), cfg, SPEC, tmp_path / "export"), head)
    proposer = FAMILY.proposer(model, SPEC)
    embedding = nn.Embedding.from_pretrained(head.embed_tokens)
    ids_h = cfg.hidden_state_ids(SPEC)
    agree = shifted_agree = corrected = 0
    contexts = _contexts(8)
    for ctx in contexts:
        ours = proposer.propose(ctx, BS - 1, SamplingParams()).token_ids
        n = ctx.token_ids.numel() - 1
        features = torch.cat([ctx.target_hidden_states[i] for i in ids_h], -1)[None]
        block = block_input_ids(ctx.token_ids[None], torch.tensor([[n]]), BS, 39)
        with torch.no_grad():
            hidden = model.block_hidden(features, block, torch.tensor([[n]]), torch.tensor([[True]]))[0]  # [1, B, H]

            def rollout(shift: bool, pool: int, hidden: torch.Tensor = hidden,
                        bonus: torch.Tensor = ctx.token_ids[-1:]) -> list[int]:
                out = domino.domino_greedy_rollout(
                    draft_hidden=hidden, bonus_tokens=bonus, target_embedding=embedding,
                    lm_head_weight=head.lm_head, prefix_gru=model.prefix_gru, embed_proj=model.embed_proj,
                    vocab_size=SPEC.vocab_size, shift_label=shift, candidate_pool_size=pool, in_cuda_graph=False)
                return [int(t) for t in out[0]]

            theirs, pooled = rollout(True, 0), rollout(True, 2048)  # full vocab; SGLang's default pool (>= V)
            base = (hidden[0, : BS - 1] @ head.lm_head.T).argmax(-1).tolist()
        agree += int(theirs == ours.tolist() == pooled)
        shifted_agree += int(rollout(False, 0) == ours.tolist())
        corrected += int(base[1:] != ours.tolist()[1:])
    print(f"domino vs SGLang rollout: {agree}/{len(contexts)} equal; shift_label=False equal {shifted_agree}; "
          f"the head changed the base argmax in {corrected}")
    assert agree == len(contexts)
    assert corrected >= len(contexts) // 2  # the correction head matters in the comparison
    assert shifted_agree < len(contexts) // 2  # the planted label shift is visible
