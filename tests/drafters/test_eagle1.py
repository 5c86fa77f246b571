"""EAGLE-1 model, objective, proposer and family on tiny random targets (transformers-free)."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import pytest
import torch
from drafter_targets import TargetOutput, TinyTarget, tiny_spec

from drafters import get_family
from drafters.common.losses import smooth_l1_rows
from drafters.common.sampling import SamplingParams
from drafters.common.target import TargetHead
from drafters.eagle1 import FAMILY, Eagle1Config, Eagle1Model
from drafters.eagle1.objective import eagle1_objective, shift_rows
from drafters.spec_decode import autoregressive_generate, speculative_generate
from feature_store import Layout


def _sample(target: TinyTarget, ids: torch.Tensor, prompt: int) -> dict[str, torch.Tensor]:
    mask = torch.ones(ids.numel(), dtype=torch.uint8)
    mask[:prompt] = 0
    s = target.features(ids, (1,), mask)
    s.pop("aux_hidden")  # EAGLE-1 reads only the post-norm last hidden
    return s


def _batch(target: TinyTarget, lengths: tuple[int, ...], seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return FAMILY.collate([_sample(target, torch.randint(0, target.spec.vocab_size, (n,), generator=g), n // 3)
                           for n in lengths])


def _model(target: TinyTarget, seed: int = 1, **kw: object) -> Eagle1Model:
    torch.manual_seed(seed)
    return FAMILY.build(Eagle1Config(attn_backend="sdpa", **kw), target.head())  # type: ignore[arg-type]


def test_parameter_names_frozen_pieces_and_layout() -> None:
    target = TinyTarget(tiny_spec())
    model = _model(target)
    h = 16
    assert {k: tuple(v.shape) for k, v in model.state_dict().items()} == {
        "fc.weight": (h, 2 * h),
        "layers.0.self_attn.q_proj.weight": (16, h), "layers.0.self_attn.k_proj.weight": (8, h),
        "layers.0.self_attn.v_proj.weight": (8, h), "layers.0.self_attn.o_proj.weight": (h, 16),
        "layers.0.post_attention_layernorm.weight": (h,),
        "layers.0.mlp.gate_proj.weight": (32, h), "layers.0.mlp.up_proj.weight": (32, h),
        "layers.0.mlp.down_proj.weight": (h, 32), "embed_tokens.weight": (32, h),
    }  # no layers.0.input_layernorm, no norm, no lm_head, no fc.bias
    assert model.fc.bias is None and "embed_tokens.weight" not in {n for n, p in model.named_parameters()
                                                                   if p.requires_grad}
    assert torch.equal(model.target_lm_head, target.lm_head.weight)
    assert torch.equal(model.embed_tokens.weight, target.embed_tokens.weight)
    assert FAMILY.required_layout(Eagle1Config(), target.spec) == Layout(layer_ids=(), last_hidden="post_norm")
    assert FAMILY.required_fields(Eagle1Config()) == ("input_ids", "loss_mask", "last_hidden")
    assert get_family("eagle1") is FAMILY
    for bad in ({"feature_noise": -0.1}, {"attn_backend": "xla"}, {"value_weight": 0.0, "prob_weight": 0.0}):
        with pytest.raises(ValueError):
            Eagle1Config(**bad)  # type: ignore[arg-type]


def test_shift_rows_worked_example() -> None:
    # T = 5: sample 0 has length 4 (+1 pad), tokens [x0..x3] = [11, 12, 13, 14], loss_mask [0, 1, 1, 1, 0]
    feats = torch.arange(1.0, 11.0).view(2, 5, 1).expand(2, 5, 2).clone()  # f_p = p + 1 (sample 0)
    batch = {"input_ids": torch.tensor([[11, 12, 13, 14, 0], [21, 22, 23, 24, 25]]),
             "loss_mask": torch.tensor([[0, 1, 1, 1, 0], [1, 1, 0, 1, 1]]),
             "attention_mask": torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]], dtype=torch.bool),
             "last_hidden": feats}
    rows = shift_rows(batch)
    assert rows.input_ids.tolist() == [[12, 13, 14, 0, 0], [22, 23, 24, 25, 0]]  # row t holds x_{t+1}
    assert rows.input_features[..., 0].tolist() == [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]]  # row t holds f_t
    assert rows.target_features[..., 0].tolist() == [[2, 3, 4, 5, 0], [7, 8, 9, 10, 0]]  # row t regresses f_{t+1}
    # loss_mask at the row itself; the last real row (no f_{t+1}) and padding are 0
    assert rows.row_mask.int().tolist() == [[0, 1, 1, 0, 0], [1, 1, 0, 1, 0]]


def test_smooth_l1_rows_worked_example() -> None:
    num, den = smooth_l1_rows(torch.tensor([[0.0, 3.0], [9.0, 9.0]]), torch.tensor([[0.5, 0.0], [0.0, 0.0]]),
                              torch.tensor([1, 0]))
    assert (float(num), float(den)) == (1.3125, 1.0)  # (0.5 * 0.25 + (3 - 0.5)) / 2; row 1 masked out


def _smooth_l1(d: float) -> float:
    return 0.5 * d * d if abs(d) < 1 else abs(d) - 0.5


@pytest.mark.parametrize("training", [False, True])
def test_objective_matches_slow_reference(training: bool) -> None:
    target = TinyTarget(tiny_spec())
    model = _model(target, feature_noise=0.2).train(training)
    batch = _batch(target, (9, 6, 4))
    out = eagle1_objective(model, batch, torch.Generator().manual_seed(7))
    u = torch.rand(batch["last_hidden"].shape, generator=torch.Generator().manual_seed(7))  # the same draw
    head = target.lm_head.weight
    vnum = pnum = 0.0
    den = hits = 0
    for b, n in enumerate(batch["lengths"].tolist()):  # one unpadded sample at a time, rows 0..n-2
        ids, f, lm = batch["input_ids"][b, :n], batch["last_hidden"][b, :n], batch["loss_mask"][b, :n]
        noisy = f[: n - 1] + ((u[b, : n - 1] - 0.5) * 0.2 * 512 / n if training else 0.0)
        with torch.no_grad():
            pred = model(ids[1:][None], noisy[None], torch.ones(1, n - 1, dtype=torch.bool))[0]
        for t in range(n - 1):
            if not lm[t]:
                continue
            want = f[t + 1]  # never noised
            vnum += sum(_smooth_l1(float(a - w)) for a, w in zip(pred[t], want)) / len(want)
            zt, zd = (want @ head.T).tolist(), (pred[t] @ head.T).tolist()
            mt, md = max(zt), max(zd)
            pt = [math.exp(z - mt) / sum(math.exp(y - mt) for y in zt) for z in zt]
            lse = md + math.log(sum(math.exp(z - md) for z in zd))
            pnum += -sum(p * (z - lse) for p, z in zip(pt, zd))
            hits += int(max(range(len(zd)), key=zd.__getitem__) == max(range(len(zt)), key=zt.__getitem__))
            den += 1
    assert den == 5 + 3 + 2  # rows t with loss_mask[t] and t + 1 < n: 3..7, 2..4, 1..2
    torch.testing.assert_close(out.numerators.detach(), torch.tensor([vnum, pnum]), rtol=1e-5, atol=1e-5)
    assert out.denominators.tolist() == [den, den] and out.weights.tolist() == pytest.approx([1.0, 0.1])
    assert [float(x) for x in out.metrics["acc_step0"]] == [hits, den]


def test_noise_is_training_only_seeded_and_switchable() -> None:
    target = TinyTarget(tiny_spec())
    batch = _batch(target, (9, 6))

    def loss(model: Eagle1Model, seed: int) -> float:
        return float(eagle1_objective(model, batch, torch.Generator().manual_seed(seed)).loss().detach())

    noisy = _model(target).train()
    assert loss(noisy, 0) == loss(noisy, 0) and loss(noisy, 0) != loss(noisy, 1)
    clean = loss(noisy.eval(), 0)
    assert clean == loss(noisy, 1)  # eval mode: no noise
    assert loss(_model(target, feature_noise=0.0).train(), 0) == clean  # 0 disables it


def test_gradients_are_finite_and_reach_only_trainable_weights() -> None:
    target = TinyTarget(tiny_spec())
    model = _model(target).train()
    FAMILY.objective(model, _batch(target, (12, 7))).loss().backward()
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and bool(torch.isfinite(p.grad).all()) and float(p.grad.abs().sum()) > 0, name
    assert model.embed_tokens.weight.grad is None and model.target_lm_head.grad is None


def test_step_feeds_back_its_own_feature_like_the_teacher_forced_pass() -> None:
    target = TinyTarget(tiny_spec())
    model = _model(target).eval()
    s = _sample(target, torch.randint(0, 32, (10,), generator=torch.Generator().manual_seed(4)), 0)
    ids, f = s["input_ids"], s["last_hidden"]
    n = 5  # committed x_0..x_5, features f_0..f_4
    state = model.prefill(ids[1 : n + 1][None], f[:n][None])
    with torch.no_grad():
        full = model(ids[1 : n + 1][None], f[:n][None], torch.ones(1, n, dtype=torch.bool))[0]
    torch.testing.assert_close(state.feature[0], full[-1])
    torch.testing.assert_close(state.logits[0], full[-1] @ target.lm_head.weight.T)
    feats, toks = f[:n], ids[1 : n + 1]
    for d in (7, 3):  # two steps: the fed feature is the previous step's prediction, not f_n
        feats, toks = torch.cat([feats, state.feature]), torch.cat([toks, torch.tensor([d])])
        state = model.step(state, torch.tensor([d]))
        with torch.no_grad():
            full = model(toks[None], feats[None], torch.ones(1, toks.numel(), dtype=torch.bool))[0]
        torch.testing.assert_close(state.feature[0], full[-1], atol=1e-6, rtol=1e-5)


def _trained(target: TinyTarget, steps: int = 120) -> Eagle1Model:
    g = torch.Generator().manual_seed(11)
    samples = []
    for _ in range(12):  # the target's own greedy continuations: what a draft meets at inference
        prompt = torch.randint(0, 32, (4,), generator=g)
        ids = torch.cat([prompt, autoregressive_generate(target, prompt, 20)])
        samples.append(_sample(target, ids, 4))
    batch = FAMILY.collate(samples)
    model = _model(target).train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    losses = []
    for _ in range(steps):
        loss = FAMILY.objective(model, batch).loss()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.5 * losses[0], losses[::20]
    return model.eval()


def test_trained_draft_is_lossless_and_accepts_under_greedy() -> None:
    target = TinyTarget(tiny_spec(), seed=3)
    proposer = FAMILY.proposer(_trained(target), target.spec)
    accepted = 0
    for seed in range(4):
        prompt = torch.randint(0, 32, (5,), generator=torch.Generator().manual_seed(100 + seed))
        res = speculative_generate(target, proposer, prompt, num_speculative_tokens=3, max_new_tokens=16)
        assert torch.equal(res.token_ids, autoregressive_generate(target, prompt, 16))
        s = res.stats
        assert s.num_draft_tokens == 3 * s.num_drafts and s.accepted_per_pos == sorted(s.accepted_per_pos)[::-1]
        accepted += s.num_accepted
    assert accepted > 8, accepted  # the trained draft is informative (a random one accepts ~1 in 30, see below)


@dataclass
class _EmbeddingBigram(torch.nn.Module):
    """logits[t] = table[x_t]; every hidden state is emb[x_t] (so the EAGLE-1 feature is defined)."""

    table: torch.Tensor
    emb: torch.Tensor

    def __post_init__(self) -> None:
        super().__init__()

    def forward(self, input_ids: torch.Tensor, output_hidden_states: bool = False) -> TargetOutput:
        h = self.emb[input_ids]
        return TargetOutput(self.table[input_ids], (h, h) if output_hidden_states else None)

    __hash__ = torch.nn.Module.__hash__


@pytest.mark.parametrize("draft_sampling", ["greedy", "probabilistic"])
def test_sampling_with_the_eagle1_proposer_is_lossless(draft_sampling: str) -> None:
    # Bigram target over 3 tokens: the exact law of 3 generated tokens after prompt [0] is known.
    table = torch.log(torch.tensor([[0.2, 0.5, 0.3], [0.6, 0.15, 0.25], [0.3, 0.3, 0.4]]))
    prob = table.exp().tolist()
    exact = {c: prob[0][c[0]] * prob[c[0]][c[1]] * prob[c[1]][c[2]] for c in itertools.product(range(3), repeat=3)}
    spec = tiny_spec(vocab=3, hidden=8, layers=1, heads=2, kv_heads=1)
    gen = torch.Generator().manual_seed(0)
    head = TargetHead(spec, torch.randn(3, 8, generator=gen), 3.0 * torch.randn(3, 8, generator=gen), torch.ones(8))
    torch.manual_seed(2)
    draft = FAMILY.build(Eagle1Config(attn_backend="sdpa"), head).eval()
    target = _EmbeddingBigram(table, torch.randn(3, 8, generator=gen))
    proposer = FAMILY.proposer(draft, spec)
    g = torch.Generator().manual_seed(1234)
    n, counts, accepted = 1000, dict[tuple[int, ...], int](), 0
    for _ in range(n):
        res = speculative_generate(target, proposer, torch.tensor([0]), num_speculative_tokens=2, max_new_tokens=3,
                                   sampling=SamplingParams(temperature=1.0), draft_sampling=draft_sampling,  # type: ignore[arg-type]
                                   generator=g)
        key = tuple(res.token_ids.tolist())
        counts[key] = counts.get(key, 0) + 1
        accepted += res.stats.num_accepted
    assert 0.05 * n < accepted < 1.9 * n, accepted  # both the acceptance and the rejection paths ran often
    chi2 = sum((counts.get(c, 0) - n * p) ** 2 / (n * p) for c, p in exact.items())
    assert chi2 < 54.05, chi2  # 26 degrees of freedom: P(chi2 > 54.05) = 0.001 under losslessness
    uniform = {c: 1 / 27 for c in exact}  # power: the sampled law is far from a wrong one
    assert sum((counts.get(c, 0) - n * p) ** 2 / (n * p) for c, p in uniform.items()) > 100


def test_family_seam_settings_and_target_head() -> None:
    target = TinyTarget(tiny_spec())
    model = _model(target)
    assert FAMILY.resolve(Eagle1Config(), target.spec) == Eagle1Config()
    assert FAMILY.with_settings(model, feature_noise=0.0) is model and FAMILY.config_of(model).feature_noise == 0.0
    with pytest.raises(ValueError, match=r"settings \['num_layers'\] are not EAGLE-1 settings"):
        FAMILY.with_settings(model, num_layers=2)
    new = TinyTarget(tiny_spec(), seed=9)  # a new policy version of the target
    FAMILY.set_target_head(model, new.embed_tokens.weight.detach(), new.lm_head.weight.detach())
    assert torch.equal(model.embed_tokens.weight, new.embed_tokens.weight)
    assert torch.equal(model.target_lm_head, new.lm_head.weight)
    out = FAMILY.objective(model.eval(), _batch(new, (8,)), progress=0.5)
    assert out.numerators.shape == (2,) and bool(torch.isfinite(out.loss()))
