"""The family contract (docs/internals.md, drafters section), for EVERY implemented family.

Parametrised over `drafters.registry.available_families()`, so a new family is covered as soon as
it is registered (docs/adding-a-family.md; tests/drafters/test_toy_family.py runs these same functions
on a family from another package); everything below goes through the family protocol only (`get_family(name)`:
config_cls, resolve, build, required_layout / required_fields, collate, objective, export,
engine_format, load_export, proposer, and the optional tree methods of a `TreeDrafterFamily`).

Debug-size target with odd shapes (vocab 37, hidden 21, 3 heads of head_dim 6 over 1 kv head,
intermediate 34, 7 layers; its norm weights are non-unit). Per family, only the settings in
`DEBUG_SETTINGS` differ from the config's defaults (EAGLE-3: non-default aux ids, a reduced draft
vocab, a short TTT); a new family runs with its defaults plus `attn_backend="sdpa"` where it has one.

Asserted per family:
- the objective runs on the family's collated synthetic samples and gives finite, non-zero
  gradients on every trainable parameter (none on the frozen embedding), and the micro-batch
  split of one batch gives the loss of the whole batch (the trainer's all-reduce rule);
- export -> load_export is exact: every entry of the model's state dict bit-equal, the resolved
  config equal outside the mutable (training-only) settings, `export_family` names the family;
- `engine_format(cfg, spec).engine_tensors(state)` == the export's `model.safetensors` (names,
  dtypes, values), for every export format, and the engine format survives `to_dict` /
  `engine_format_from_dict` and equals the one recorded in the export's meta;
- the reference decoder with the family's proposer (and its tree proposer, for a tree family) is
  lossless: greedy output == `autoregressive_generate` with a briefly trained, informative draft;
  sampling (temperature 1, probabilistic drafting; a tree family with its tree decoder) by a
  chi-square test on the exact law of 3 tokens over a 3-token vocab (27 cells, 26 dof, 600
  samples, every cell expected > 5 times; threshold 54.05 = P 0.001 under the null; observed
  17-21); the same test rejects a planted lossy proposer (observed chi2 1115, asserted > 4x).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from tree_targets import MaskedTinyTarget

from drafters.common.contract import (
    EXPORT_META_FILE,
    DraftContext,
    DrafterFamily,
    Proposal,
    Proposer,
    StoreStats,
)
from drafters.common.sampling import SamplingParams
from drafters.common.target import TargetSpec
from drafters.common.tree import TreeDrafterFamily
from drafters.common.vocab import token_counts_from_samples
from drafters.registry import available_families, engine_format_from_dict, export_family, get_family
from drafters.spec_decode import autoregressive_generate, speculative_generate, tree_speculative_generate

FAMILIES = available_families()

SPEC = TargetSpec(vocab_size=37, hidden_size=21, num_hidden_layers=7, num_attention_heads=3, num_key_value_heads=1,
                  head_dim=6, intermediate_size=34, rope_theta=10000.0, rms_norm_eps=1e-6,
                  max_position_embeddings=128, model_type="qwen3", tie_word_embeddings=False)
SAMPLING_SPEC = dataclasses.replace(SPEC, vocab_size=3, num_hidden_layers=4)  # 27 cells; 4 layers: cheaper

K = 3  # chain draft length
# Per-family debug settings (functions of the target spec); anything absent keeps its default.
DEBUG_SETTINGS: dict[str, Any] = {
    "eagle1": lambda spec: {"feature_noise": 0.0},
    "eagle2": lambda spec: {"feature_noise": 0.0, "top_k": 2, "depth": 3, "total_tokens": 5},
    "eagle3": lambda spec: {"draft_vocab_size": (2 * spec.vocab_size) // 3, "ttt_steps": 3,  # 7 layers: (1, 3, 6)
                            "aux_layer_ids": (1, spec.num_hidden_layers // 2, spec.num_hidden_layers - 1)},
    # block K + 1 = 4 (3 drafts per block), 3 non-default context layers (7 layers: (0, 3, 5)), the last id as MASK
    "dflash": lambda spec: {"block_size": K + 1, "num_target_features": 3, "mask_token_id": spec.vocab_size - 1,
                            "target_layer_ids": (0, (spec.num_hidden_layers - 1) // 2, spec.num_hidden_layers - 2)},
    # block K = 3 (every slot drafts), rank-4 Markov head, the same context layers and MASK as dflash
    "dspark": lambda spec: {"block_size": K, "num_target_features": 3, "mask_token_id": spec.vocab_size - 1,
                            "markov_rank": 4,
                            "target_layer_ids": (0, (spec.num_hidden_layers - 1) // 2, spec.num_hidden_layers - 2)},
    # block K + 1 = 4 (3 drafts, shifted labels), a small GRU head trained from step 0 (no curriculum:
    # the contract's trainer passes no progress), the same context layers and MASK as dflash
    "domino": lambda spec: {"block_size": K + 1, "num_target_features": 3, "mask_token_id": spec.vocab_size - 1,
                            "gru_hidden_dim": 8, "emb_dim": 8, "lambda_decay_fraction": 0.0,
                            "target_layer_ids": (0, (spec.num_hidden_layers - 1) // 2, spec.num_hidden_layers - 2)},
    # K = 3 depths in one forward, 2 layers (layer 1 plain), the EAGLE-3 debug ids and draft vocab, the last id as
    # MASK; COD ratio 1 keeps every chain, so a micro-batch split sees the same elements as the whole batch (like
    # dflash's 512 anchors: every candidate; random COD draws are tested in tests/drafters/test_peagle.py)
    "peagle": lambda spec: {"draft_vocab_size": (2 * spec.vocab_size) // 3, "num_layers": 2, "num_depths": K,
                            "mask_token_id": spec.vocab_size - 1, "cod_ratio": 1.0,
                            "aux_layer_ids": (1, spec.num_hidden_layers // 2, spec.num_hidden_layers - 1)},
}
# Training sequences of the `trained` fixture (default 12). DFlash drafts a block in parallel from
# mid-stack features: on 12 sequences it memorises (loss 0.02, greedy acceptance 9/159, near chance);
# on 48 it generalises (29/93 observed).
TRAIN_SEQUENCES: dict[str, int] = {"dflash": 48, "dspark": 48, "domino": 48}
EXPORT_FORMATS: dict[str, tuple[str, ...]] = {"eagle3": ("native", "speculators")}  # default: ("native",)
CHI2_26_DOF_P001 = 54.05  # 27 cells, 26 degrees of freedom: P(chi2 > 54.05) = 0.001 under the null


def _config(family: DrafterFamily, spec: TargetSpec) -> Any:
    cfg = family.config_cls()
    names = {f.name for f in dataclasses.fields(cfg)}
    settings = {"attn_backend": "sdpa"} if "attn_backend" in names else {}
    settings.update(DEBUG_SETTINGS.get(family.name, lambda s: {})(spec))
    return family.resolve(dataclasses.replace(cfg, **settings), spec)


def _target(spec: TargetSpec, seed: int, lm_scale: float = 1.0) -> MaskedTinyTarget:
    target = MaskedTinyTarget(spec, seed=seed).eval()
    gen = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for name, p in target.named_parameters():
            if name.endswith("norm.weight"):  # non-unit norms: a pre/post-norm mix-up shows
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
        target.lm_head.weight.mul_(lm_scale)
    return target


def _sample(family: DrafterFamily, cfg: Any, target: MaskedTinyTarget, ids: torch.Tensor,
            prompt_len: int) -> dict[str, torch.Tensor]:
    """One feature-store sample with exactly the family's fields at its layout."""
    layout = family.required_layout(cfg, target.spec)
    with torch.no_grad():
        out = target(ids[None], output_hidden_states=True)
    assert out.hidden_states is not None
    hs = [h[0] for h in out.hidden_states]  # L + 1 entries; the last one is post-final-norm
    mask = torch.ones(ids.numel(), dtype=torch.uint8)
    mask[:prompt_len] = 0
    have = {"input_ids": ids.long(), "loss_mask": mask, "last_hidden": hs[-1]}
    if layout.layer_ids:
        have["aux_hidden"] = torch.cat([hs[i] for i in layout.layer_ids], dim=-1)
    fields = family.required_fields(cfg)
    missing = [f for f in fields if f not in have]
    assert not missing, f"{family.name} requires fields {missing}: teach this test to synthesise them"
    return {f: have[f] for f in fields}


def _random_samples(family: DrafterFamily, cfg: Any, target: MaskedTinyTarget, lengths: tuple[int, ...],
                    seed: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [_sample(family, cfg, target, torch.randint(0, target.spec.vocab_size, (n,), generator=g), n // 3)
            for n in lengths]


def _greedy_samples(family: DrafterFamily, cfg: Any, target: MaskedTinyTarget, n: int, seed: int,
                    prompt_len: int = 4, new_tokens: int = 20) -> list[dict[str, torch.Tensor]]:
    """The target's own greedy continuations: what a draft meets at inference."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        prompt = torch.randint(0, target.spec.vocab_size, (prompt_len,), generator=g)
        ids = torch.cat([prompt, autoregressive_generate(target, prompt, new_tokens)])
        out.append(_sample(family, cfg, target, ids, prompt_len))
    return out


def _build(family: DrafterFamily, cfg: Any, target: MaskedTinyTarget, samples: list[dict[str, torch.Tensor]],
           seed: int) -> torch.nn.Module:
    stats = StoreStats(token_counts=token_counts_from_samples(samples, target.spec.vocab_size))
    torch.manual_seed(seed)
    return family.build(cfg, target.head(), stats)


def _trainable(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def train_family(name: str) -> dict[str, Any]:
    """Family `name` (through the catalog): the debug target, the resolved config and a draft trained
    for a few seconds on the target's greedy continuations (acceptance well above chance, so lossless
    greedy decoding exercises the acceptance path, and exported weights are no longer their initial
    values). The `trained` fixture of every catalog family; tests/drafters/test_toy_family.py reuses it."""
    family = get_family(name)
    target = _target(SPEC, seed=3)
    cfg = _config(family, SPEC)
    samples = _greedy_samples(family, cfg, target, TRAIN_SEQUENCES.get(name, 12), seed=11)
    model = _build(family, cfg, target, samples, seed=1).train()
    batch = family.collate(samples)
    opt = torch.optim.AdamW([p for _, p in _trainable(model)], lr=3e-3)
    losses = []
    for step in range(100):
        loss = family.objective(model, batch, progress=step / 100).loss()
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.7 * losses[0], (name, losses[::20])
    return {"name": name, "family": family, "target": target, "cfg": cfg, "model": model.eval(), "samples": samples}


@pytest.fixture(scope="module", params=FAMILIES)
def trained(request: pytest.FixtureRequest) -> Iterator[dict[str, Any]]:
    """`train_family(name)` per catalog family, on one intra-op thread."""
    before = torch.get_num_threads()
    torch._C.set_num_threads(1)
    yield train_family(request.param)
    torch._C.set_num_threads(before)


@pytest.mark.parametrize("name", FAMILIES)
def test_objective_runs_and_gives_finite_gradients(name: str) -> None:
    family = get_family(name)
    target = _target(SPEC, seed=0)
    cfg = _config(family, SPEC)
    samples = _random_samples(family, cfg, target, (11, 7, 5), seed=2)
    model = _build(family, cfg, target, samples, seed=1).train()
    out = family.objective(model, family.collate(samples), progress=0.3)
    loss = out.loss()
    assert out.numerators.shape == out.denominators.shape == out.weights.shape and bool(torch.isfinite(loss))
    loss.backward()
    for pname, p in _trainable(model):
        assert p.grad is not None and bool(torch.isfinite(p.grad).all()), pname
        assert float(p.grad.abs().sum()) > 0, f"{name}: no gradient reaches {pname}"
    frozen = [n for n, p in model.named_parameters() if not p.requires_grad]
    assert all(p.grad is None for n, p in model.named_parameters() if n in frozen)
    # The trainer's rule: micro-batches' numerators and denominators add up to the whole batch's loss.
    model.eval()
    with torch.no_grad():
        whole = family.objective(model, family.collate(samples))
        parts = [family.objective(model, family.collate(samples[:1])),
                 family.objective(model, family.collate(samples[1:]))]
    den = sum(p.denominators for p in parts)
    num = sum(p.numerators for p in parts)
    assert isinstance(den, torch.Tensor) and isinstance(num, torch.Tensor)
    # equal up to float summation order (DFlash's slot weights are not integers)
    torch.testing.assert_close(den, whole.denominators, rtol=1e-6, atol=0.0)
    split = dataclasses.replace(whole, numerators=num).loss(den)
    torch.testing.assert_close(split, whole.loss(), rtol=1e-5, atol=1e-6)


def _fixed_fields(family: DrafterFamily, cfg: Any) -> dict[str, Any]:
    return {k: v for k, v in dataclasses.asdict(cfg).items() if k not in family.mutable_settings}


def test_export_load_export_round_trip_is_exact(trained: dict[str, Any], tmp_path: Path) -> None:
    family, model, cfg, target = trained["family"], trained["model"], trained["cfg"], trained["target"]
    out = family.export(model, cfg, target.spec, tmp_path / "export")
    assert export_family(out) == trained["name"]
    loaded = family.load_export(out, target.head())
    assert not loaded.training and type(loaded) is type(model)
    want, got = model.state_dict(), loaded.state_dict()
    assert sorted(got) == sorted(want)
    for key, value in want.items():
        assert got[key].dtype == value.dtype and torch.equal(got[key], value), key
    assert _fixed_fields(family, family.config_of(loaded)) == _fixed_fields(family, cfg)


def test_engine_tensors_equal_the_exported_file(trained: dict[str, Any], tmp_path: Path) -> None:
    family, model, cfg, spec = trained["family"], trained["model"], trained["cfg"], trained["target"].spec
    fmt = family.engine_format(cfg, spec)
    doc = json.loads(json.dumps(fmt.to_dict()))  # as a publish manifest carries it
    assert doc["family"] == trained["name"] and engine_format_from_dict(doc) == fmt
    for export_fmt in EXPORT_FORMATS.get(trained["name"], ("native",)):
        out = family.export(model, cfg, spec, tmp_path / export_fmt, fmt=export_fmt)
        on_disk = load_file(str(out / "model.safetensors"))
        tensors = fmt.engine_tensors(model.state_dict(), export_fmt)
        assert sorted(tensors) == sorted(on_disk), export_fmt
        for key, value in tensors.items():
            assert value.dtype == on_disk[key].dtype and torch.equal(value, on_disk[key]), (export_fmt, key)
        assert json.loads((out / EXPORT_META_FILE).read_text())["engine_format"] == doc
        again = fmt.export(model.state_dict(), tmp_path / f"{export_fmt}_by_format", export_fmt)
        assert (again / "config.json").read_text() == (out / "config.json").read_text()
        assert load_file(str(again / "model.safetensors")).keys() == on_disk.keys()


PROMPTS = [[5, 9, 13, 30, 2], [7, 7, 8], [36, 0, 1, 2, 3, 4, 5, 6]]


def test_reference_decoder_is_lossless_greedy(trained: dict[str, Any]) -> None:
    family, model, target = trained["family"], trained["model"], trained["target"]
    proposer = family.proposer(model, target.spec)
    accepted = drafted = 0
    for prompt in PROMPTS:
        p = torch.tensor(prompt)
        want = autoregressive_generate(target, p, 20)
        res = speculative_generate(target, proposer, p, num_speculative_tokens=K, max_new_tokens=20)
        assert torch.equal(res.token_ids, want), prompt
        accepted, drafted = accepted + res.stats.num_accepted, drafted + res.stats.num_draft_tokens
        if isinstance(family, TreeDrafterFamily):
            tree = dataclasses.asdict(family.tree_config(family.config_of(model)))
            res = tree_speculative_generate(target, family.tree_proposer(model, target.spec), p,
                                            max_new_tokens=20, **tree)
            assert torch.equal(res.token_ids, want), (prompt, tree)
    print(f"{trained['name']}: greedy chain accepted {accepted}/{drafted}")
    # an informative draft (3x chance, 1/37 per token): the acceptance path ran
    assert accepted > 0.08 * drafted, (accepted, drafted)


def _exact_law(target: MaskedTinyTarget, prompt: list[int]) -> dict[tuple[int, ...], float]:
    """P(x1, x2, x3 | prompt) at temperature 1, by enumerating the 1 + 3 + 9 prefixes."""
    def probs(seq: tuple[int, ...]) -> list[float]:
        with torch.no_grad():
            logits = target(torch.tensor([*prompt, *seq])[None]).logits[0, -1]
        return torch.softmax(logits.double(), -1).tolist()

    law = {}
    for c in itertools.product(range(3), repeat=3):
        law[c] = probs(())[c[0]] * probs(c[:1])[c[1]] * probs(c[:2])[c[2]]
    return law


def _sampled_law(family: DrafterFamily, model: torch.nn.Module, target: MaskedTinyTarget, prompt: list[int],
                 n: int, tree: bool) -> tuple[dict[tuple[int, ...], int], int]:
    g = torch.Generator().manual_seed(1234)
    counts: dict[tuple[int, ...], int] = {}
    accepted = 0
    for _ in range(n):
        if tree:
            assert isinstance(family, TreeDrafterFamily)
            res = tree_speculative_generate(target, family.tree_proposer(model, target.spec), torch.tensor(prompt),
                                            max_new_tokens=3, sampling=SamplingParams(temperature=1.0), generator=g,
                                            **dataclasses.asdict(family.tree_config(family.config_of(model))))
        else:
            res = speculative_generate(target, family.proposer(model, target.spec), torch.tensor(prompt),
                                       num_speculative_tokens=2, max_new_tokens=3,
                                       sampling=SamplingParams(temperature=1.0), draft_sampling="probabilistic",
                                       generator=g)
        key = tuple(res.token_ids.tolist())
        counts[key] = counts.get(key, 0) + 1
        accepted += res.stats.num_accepted
    return counts, accepted


def _chi_square(counts: dict[tuple[int, ...], int], law: dict[tuple[int, ...], float], n: int) -> float:
    return sum((counts.get(c, 0) - n * p) ** 2 / (n * p) for c, p in law.items())


SAMPLING_N = 600
SAMPLING_PROMPT = [0, 2, 1, 1]


def _sampling_setup(name: str) -> tuple[DrafterFamily, torch.nn.Module, MaskedTinyTarget, dict[tuple[int, ...], float]]:
    family = get_family(name)
    target = _target(SAMPLING_SPEC, seed=5, lm_scale=0.1)  # moderate entropy: every cell is expected > 5 times
    cfg = _config(family, SAMPLING_SPEC)
    model = _build(family, cfg, target, _random_samples(family, cfg, target, (9, 8), seed=4), seed=2).eval()
    law = _exact_law(target, SAMPLING_PROMPT)
    assert min(law.values()) * SAMPLING_N > 5, min(law.values())  # chi-square's expected-count rule
    return family, model, target, law


@pytest.mark.parametrize("name", FAMILIES)
def test_reference_decoder_is_lossless_sampling(name: str) -> None:
    """A tree family is sampled with its tree decoder (what its reference evaluation runs,
    verl_speco/evaluation.py); its chain proposer is covered by the greedy test. 600 samples."""
    family, model, target, law = _sampling_setup(name)
    decoder = "tree" if isinstance(family, TreeDrafterFamily) else "chain"
    counts, accepted = _sampled_law(family, model, target, SAMPLING_PROMPT, SAMPLING_N, decoder == "tree")
    assert 0.1 * SAMPLING_N < accepted, accepted  # the acceptance path ran often (and so did rejection: random draft)
    chi2 = _chi_square(counts, law, SAMPLING_N)
    print(f"{name} {decoder}: chi2 {chi2:.1f} (threshold {CHI2_26_DOF_P001}), accepted {accepted}")
    assert chi2 < CHI2_26_DOF_P001, chi2


class _ArgmaxButReportsQ:
    """A lossy proposer: drafts the most likely token but reports the distribution q it should
    have sampled from (draft sampling silently greedy), so verification's min(1, p/q) is wrong."""

    def __init__(self, inner: Proposer):
        self.inner = inner

    def propose(self, ctx: DraftContext, num_tokens: int, sampling: SamplingParams,
                generator: torch.Generator | None = None) -> Proposal:
        out = self.inner.propose(ctx, num_tokens, sampling, generator)
        assert out.probs is not None
        return Proposal(out.probs.argmax(-1), out.probs)


def test_the_sampling_test_rejects_a_lossy_decoder() -> None:
    """Negative control of the statistical test (first family, same n and threshold): observed
    chi2 1115 for a decoder whose drafts are not drawn from the q it reports."""
    family, model, target, law = _sampling_setup(FAMILIES[0])
    lossy = _ArgmaxButReportsQ(family.proposer(model, target.spec))
    g = torch.Generator().manual_seed(1234)
    counts: dict[tuple[int, ...], int] = {}
    for _ in range(SAMPLING_N):
        res = speculative_generate(target, lossy, torch.tensor(SAMPLING_PROMPT), num_speculative_tokens=2,
                                   max_new_tokens=3, sampling=SamplingParams(temperature=1.0),
                                   draft_sampling="probabilistic", generator=g)
        key = tuple(res.token_ids.tolist())
        counts[key] = counts.get(key, 0) + 1
    chi2 = _chi_square(counts, law, SAMPLING_N)
    print(f"{FAMILIES[0]} with a lossy proposer: chi2 {chi2:.1f}")
    assert chi2 > 4 * CHI2_26_DOF_P001, chi2
