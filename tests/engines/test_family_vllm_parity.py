"""Engine parity for every family vLLM serves on CPU: vLLM drafts exactly what our reference drafts.

Parametrised over `drafters.registry.available_families()` and generic through the family
protocol (resolve, build, objective, export, engine_format().vllm_speculative_config, load_export,
proposer). Target: `build_normed_target`, a random, non-degenerate 8-layer Qwen3 (real attention
and MLP contributions, every RMSNorm weight in U[0.5, 1.5)). Draft: trained for a few seconds on
the target's own greedy continuations (`train_draft`), with the settings of `TRAIN_SETTINGS`
(EAGLE-3: NON-DEFAULT aux layer ids (1, 3, 6) instead of (2, 4, 5), a reduced draft vocab of 64 of
96, so the d2t offsets are exercised), exported by the family and served by vLLM, greedy, K = 3.

Four engine starts in all (eagle1, eagle3, the missing-key control, the speculators export);
plain decoding is HF's greedy decoding of the same target (no engine needed).

Asserted per family: vLLM's outputs == plain decoding == the reference decoder's
(`drafters.spec_decode.speculative_generate` over the HF target with `family.proposer`), and
vLLM's acceptance counters (drafts, accepted, accepted per position) == the reference's
`AcceptanceStats` exactly (float32). In greedy mode both decoders commit the same tokens, so a
round's acceptance is the length of the prefix of the K drafts that equals the target's greedy
continuation: the counters are equal round by round iff vLLM's draft tokens equal our proposer's
wherever it matters (up to the first rejected position of every round). With an informative draft
(acceptance far above chance at every position) that is a position-by-position comparison.

A family whose export is byte-identical (config.json, model.safetensors) to an already served
family's, with the same vLLM speculative config, is not served again: vLLM would see the same
inputs (today eagle2: vLLM 0.32 has no tree, eagle2 ships the eagle1 directory, method "eagle");
its own reference counters must still equal those vLLM counters.

P-EAGLE (`parallel_drafting`: K = 3 drafts from one draft forward, 2 layers) is served like
the others; measured: vLLM (68, 54, [32, 13, 9]) == reference.

Negative controls, each shown to make the comparison fail:
- P-EAGLE mask token exported as 94 (trained with 95): reference (69, 49, [30, 11, 8]); the
  plain layer's input_layernorm <-> post_attention_layernorm swapped: (69, 53, [30, 13, 10]);
- EAGLE-3 layer ids shifted by one (exported with (2, 4, 7), trained on (1, 3, 6)): the
  reference reading that export disagrees with vLLM on the correct one;
- EAGLE-3 midlayer.input_layernorm <-> midlayer.hidden_norm swapped: the reference with the
  swapped export disagrees with vLLM on the correct one;
- EAGLE-3 config.json without `eagle_aux_hidden_state_layer_ids`: vLLM does not refuse; it
  captures `eagle_config.eagle_aux_hidden_state_layer_ids` as-is (SGLang's convention, ids - 1 =
  (0, 2, 5): docs/design/engines.md section 1.3), so the counters differ, and equal the reference's at (0, 2, 5)
  (so vLLM captures exactly the layers its config names, as the shifted-ids control assumes);
- EAGLE-1 (and so eagle2): the fc halves swapped ([feature; embedding]) in the reference.
Also: the EAGLE-3 speculators-format export served by directory (`vllm serve <dir>`, the verifier
recorded) drafts exactly the same; each `generate_with_metrics` call reports its own figures and
`read_spec_metrics` the engine's running totals.

This replaces tests/engines/test_vllm_eagle3.py, whose "bigram" target had no-op layers (every
hidden state = the token's embedding), so it could not see layer ids, norm placement, attention
or RoPE; its unique assertions (per-call counting, the reduced-vocab d2t path, the speculators
export served by directory) are made here on the non-degenerate target.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from drafters.common.metrics import AcceptanceStats
from drafters.common.target import TargetHead, TargetSpec
from drafters.registry import available_families, get_family
from drafters.spec_decode import autoregressive_generate, speculative_generate

from .conftest import (
    MAX_TOKENS,
    PROMPTS,
    K,
    build_normed_target,
    engine,
    greedy_run,
    train_draft,
    vllm_counts,
)

pytestmark = pytest.mark.vllm

FAMILIES = available_families()
TRAIN_SETTINGS: dict[str, dict[str, Any]] = {  # anything absent keeps the config's default
    "eagle1": {"feature_noise": 0.0},
    "eagle2": {"feature_noise": 0.0},
    "eagle3": {"aux_layer_ids": (1, 3, 6), "draft_vocab_size": 64, "ttt_steps": 3},
    # block K + 1 (K = B - 1 drafts), NON-DEFAULT context layers (0, 3, 6) (default (1, 3, 5)), MASK = id 95
    "dflash": {"block_size": K + 1, "num_target_features": 3, "target_layer_ids": (0, 3, 6), "mask_token_id": 95},
    # K = 3 depths from ONE draft forward, 2 layers (layer 1 plain: vLLM's input_layernorm add-norm), the
    # EAGLE-3 ids and reduced vocab, MASK = id 95
    "peagle": {"aux_layer_ids": (1, 3, 6), "draft_vocab_size": 64, "num_depths": K, "num_layers": 2,
               "mask_token_id": 95},
}
# Training sequences per family (default 16): DFlash drafts a block in parallel from mid-stack
# features and needs more data to accept at its third position (on 16: per position [17, 7, 0]);
# so does P-EAGLE, whose later slots see only mask tokens.
TRAIN_SEQUENCES = {"dflash": 64, "peagle": 64}

Counts = tuple[int, int, list[int]]


def _counts(s: AcceptanceStats) -> Counts:
    return s.num_drafts, s.num_accepted, list(s.accepted_per_pos)


def _serve(target: Path, draft: Path | None, spec: dict[str, Any] | None = None) -> tuple[list[list[int]], Counts]:
    with engine(target, draft, spec) as llm:
        outputs, m = greedy_run(llm)
    assert m["num_drafts"] > 0 and m["num_draft_tokens"] == K * m["num_drafts"]
    return outputs, vllm_counts(m)


def _fingerprint(export_dir: Path, spec: dict[str, Any]) -> str:
    """What vLLM reads of a draft: config.json, model.safetensors, the speculative config."""
    h = hashlib.sha256()
    for name in ("config.json", "model.safetensors"):
        h.update((export_dir / name).read_bytes())
    h.update(json.dumps({k: v for k, v in spec.items() if k != "model"}, sort_keys=True).encode())
    return h.hexdigest()


class World:
    """The target, its plain greedy decoding (HF, no engine start) and, per family, the served draft."""

    def __init__(self, root: Path):
        from transformers import Qwen3ForCausalLM

        self.root = root
        self.target = build_normed_target(root / "target")
        self.spec = TargetSpec.from_pretrained(self.target)
        self.head = TargetHead.from_pretrained(self.target)
        self.hf = Qwen3ForCausalLM.from_pretrained(self.target).eval()
        self.baseline = [autoregressive_generate(self.hf, torch.tensor(p), MAX_TOKENS).tolist() for p in PROMPTS]
        self.families: dict[str, dict[str, Any]] = {}
        self.by_fingerprint: dict[str, tuple[str, Counts]] = {}

    def reference(self, proposer: Any) -> tuple[list[list[int]], Counts]:
        outputs, stats = [], AcceptanceStats()
        for prompt in PROMPTS:
            res = speculative_generate(self.hf, proposer, torch.tensor(prompt), num_speculative_tokens=K,
                                       max_new_tokens=MAX_TOKENS)
            outputs.append(res.token_ids.tolist())
            stats = stats.merge(res.stats)
        return outputs, _counts(stats)

    def served(self, name: str) -> dict[str, Any]:
        """Train, export and serve `name` once; later calls return the same record."""
        if name in self.families:
            return self.families[name]
        from verl_speco.engines.vllm_engine import CPU_UNSERVABLE

        if name in CPU_UNSERVABLE:
            pytest.skip(f"{name}: {CPU_UNSERVABLE[name]} (its export is checked in tests/engines/"
                        "test_dspark_vllm_loader.py / tests/drafters/test_domino.py instead)")
        family = get_family(name)
        cfg = family.config_cls()
        settings = {"attn_backend": "sdpa"} if "attn_backend" in {f.name for f in dataclasses.fields(cfg)} else {}
        cfg = family.resolve(dataclasses.replace(cfg, **settings, **TRAIN_SETTINGS.get(name, {})), self.spec)
        model = train_draft(family, cfg, self.target, num_sequences=TRAIN_SEQUENCES.get(name, 16))
        draft = family.export(model, cfg, self.spec, self.root / name)
        spec = family.engine_format(cfg, self.spec).vllm_speculative_config(draft, K)
        key = _fingerprint(draft, spec)
        if key in self.by_fingerprint:  # byte-identical to a served draft: vLLM would see the same inputs
            served_as, counts = self.by_fingerprint[key]
            outputs = self.baseline
        else:
            from verl_speco.engines.vllm_engine import read_spec_metrics

            with engine(self.target, draft, spec) as llm:
                outputs, m1 = greedy_run(llm)
                again, m2 = greedy_run(llm)
                total = read_spec_metrics(llm)
            assert again == outputs and m2 == m1  # each call's own figures, not the running totals
            assert (total["num_drafts"], total["num_accepted_tokens"]) == (2 * m1["num_drafts"],
                                                                         2 * m1["num_accepted_tokens"])
            assert m1["num_draft_tokens"] == K * m1["num_drafts"]
            served_as, counts = name, vllm_counts(m1)
            self.by_fingerprint[key] = (name, counts)
        ref_outputs, ref = self.reference(family.proposer(model, self.spec))
        self.families[name] = {"family": family, "cfg": cfg, "model": model, "draft": draft, "spec": spec,
                               "outputs": outputs, "vllm": counts, "served_as": served_as,
                               "ref_outputs": ref_outputs, "ref": ref}
        return self.families[name]


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> World:
    return World(tmp_path_factory.mktemp("parity"))


@pytest.mark.parametrize("name", FAMILIES)
def test_vllm_drafts_exactly_what_the_reference_drafts(world: World, name: str) -> None:
    r = world.served(name)
    print(f"{name} (served as {r['served_as']}): vLLM {r['vllm']} reference {r['ref']}")
    assert r["outputs"] == world.baseline  # vLLM's greedy speculative decoding == plain greedy decoding
    assert r["ref_outputs"] == world.baseline  # and so is the reference decoder (HF target)
    drafts, accepted, per_pos = r["ref"]
    # an informative draft (5x chance, ~1/96 per token; observed: eagle1 10%, eagle3 7%) accepting at every position
    assert accepted > 0.05 * K * drafts and min(per_pos) > 0, r["ref"]
    assert r["vllm"] == r["ref"]  # the same drafts round by round (float32: exact)


def _load(world: World, name: str, export_dir: Path) -> torch.nn.Module:
    return world.served(name)["family"].load_export(export_dir, world.head)


def _need(name: str) -> None:
    if name not in FAMILIES:
        pytest.skip(f"{name} is not implemented")


def test_eagle1_fc_halves_swapped_breaks_parity(world: World) -> None:
    _need("eagle1")
    r = world.served("eagle1")
    bad, h = _copy_export(r["draft"], world.root / "eagle1_fc_swapped"), world.spec.hidden_size
    tensors = load_file(str(bad / "model.safetensors"))
    w = tensors["fc.weight"]  # [H, 2H]: fc(cat[feature; embedding]), the wrong concatenation order
    tensors["fc.weight"] = torch.cat([w[:, h:], w[:, :h]], dim=1).contiguous()
    save_file(tensors, str(bad / "model.safetensors"))
    _, swapped = world.reference(r["family"].proposer(_load(world, "eagle1", bad), world.spec))
    print(f"eagle1 fc halves swapped: reference {swapped}, vLLM {r['vllm']}")
    assert swapped != r["vllm"]


def _copy_export(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_eagle3_layer_ids_shifted_by_one_break_parity(world: World) -> None:
    _need("eagle3")
    r = world.served("eagle3")
    aux = r["cfg"].aux_layer_ids
    shifted_cfg = dataclasses.replace(r["cfg"], aux_layer_ids=tuple(i + 1 for i in aux))  # (2, 4, 7)
    shifted = r["family"].export(r["model"], shifted_cfg, world.spec, world.root / "eagle3_shifted")
    assert json.loads((shifted / "config.json").read_text())["eagle_aux_hidden_state_layer_ids"] == [2, 4, 7]
    _, planted = world.reference(r["family"].proposer(_load(world, "eagle3", shifted), world.spec))
    print(f"eagle3 aux ids {aux} exported as (2, 4, 7): reference {planted}, vLLM (correct export) {r['vllm']}")
    assert planted != r["vllm"]  # the parity check fails (vLLM follows config.json's ids: see the next tests)


def test_eagle3_swapped_norms_break_parity(world: World) -> None:
    _need("eagle3")
    r = world.served("eagle3")
    bad = _copy_export(r["draft"], world.root / "eagle3_norms_swapped")
    tensors = load_file(str(bad / "model.safetensors"))
    a, b = "midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight"
    assert not torch.equal(tensors[a], tensors[b])
    tensors[a], tensors[b] = tensors[b], tensors[a]
    save_file(tensors, str(bad / "model.safetensors"))
    _, swapped = world.reference(r["family"].proposer(_load(world, "eagle3", bad), world.spec))
    print(f"eagle3 {a} <-> {b}: reference {swapped}, vLLM (correct export) {r['vllm']}")
    assert swapped != r["vllm"]


def test_eagle3_missing_layer_ids_key_breaks_parity(world: World) -> None:
    _need("eagle3")
    r = world.served("eagle3")
    bad = _copy_export(r["draft"], world.root / "eagle3_no_ids")
    config = json.loads((bad / "config.json").read_text())
    del config["eagle_aux_hidden_state_layer_ids"]  # vLLM's key; SGLang's eagle_config ids stay
    sglang_ids = tuple(config["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
    assert sglang_ids == (0, 2, 5)  # SGLang's "output of layer i" = internal - 1
    (bad / "config.json").write_text(json.dumps(config))
    outputs, counts = _serve(world.target, bad, r["spec"] | {"model": str(bad)})  # vLLM does not refuse it
    proposer = r["family"].proposer(r["model"], world.spec)
    proposer.aux_layer_ids = sglang_ids  # type: ignore[attr-defined]  # what vLLM captures (docs/design/engines.md section 1.3)
    _, planted = world.reference(proposer)
    print(f"eagle3 without eagle_aux_hidden_state_layer_ids: vLLM {counts}; reference {r['ref']}, "
          f"reference at eagle_config's ids {sglang_ids} {planted}")
    assert outputs == world.baseline
    assert counts != r["ref"]  # the parity check fails
    assert counts == planted  # vLLM read eagle_config's ids as capture indices


def test_eagle3_speculators_export_served_by_directory(world: World) -> None:
    _need("eagle3")
    r = world.served("eagle3")
    spec_dir = r["family"].export(r["model"], r["cfg"], world.spec, world.root / "eagle3_speculators",
                                  fmt="speculators", verifier=str(world.target), speculative_tokens=K,
                                  verifier_architectures=["Qwen3ForCausalLM"])
    # `vllm serve <dir>`: the speculators config names the target (verifier), the method and K
    outputs, counts = _serve(spec_dir, None)
    assert outputs == world.baseline
    assert counts == r["ref"] == r["vllm"]


def test_dflash_layer_ids_shifted_by_one_break_parity(world: World) -> None:
    _need("dflash")
    r = world.served("dflash")
    ids = r["cfg"].target_layer_ids
    shifted_cfg = dataclasses.replace(r["cfg"], target_layer_ids=(ids[0] + 1, ids[1] + 1, ids[2]))  # (1, 4, 6)
    shifted = r["family"].export(r["model"], shifted_cfg, world.spec, world.root / "dflash_shifted")
    config = json.loads((shifted / "config.json").read_text())
    assert config["dflash_config"]["target_layer_ids"] == [1, 4, 6]
    assert config["eagle_aux_hidden_state_layer_ids"] == [2, 5, 7]  # vLLM's capture index = output-of-layer + 1
    _, planted = world.reference(r["family"].proposer(_load(world, "dflash", shifted), world.spec))
    print(f"dflash ids {ids} exported as (1, 4, 6): reference {planted}, vLLM (correct export) {r['vllm']}")
    assert planted != r["vllm"]


def test_dflash_swapped_norms_break_parity(world: World) -> None:
    _need("dflash")
    r = world.served("dflash")
    bad = _copy_export(r["draft"], world.root / "dflash_norms_swapped")
    tensors = load_file(str(bad / "model.safetensors"))
    a, b = "hidden_norm.weight", "norm.weight"  # the context norm and the final norm
    assert not torch.equal(tensors[a], tensors[b])
    tensors[a], tensors[b] = tensors[b], tensors[a]
    save_file(tensors, str(bad / "model.safetensors"))
    _, swapped = world.reference(r["family"].proposer(_load(world, "dflash", bad), world.spec))
    print(f"dflash {a} <-> {b}: reference {swapped}, vLLM (correct export) {r['vllm']}")
    assert swapped != r["vllm"]


def test_vllm_cpu_dflash_context_k_norm_bug_b_and_its_fix() -> None:
    """Bug B (verl_speco/cpu_port/vllm_dflash.py): vLLM's CPU `rms_norm` given DFlash's grouped
    k_norm weights [L, head_dim] applies row 0 to every layer; our replacement of
    `_normalize_context_k` applies row i to layer i (the parity above holds with it installed)."""
    import vllm._custom_ops as ops
    from vllm.model_executor.models import qwen3_dflash

    from verl_speco.cpu_port import vllm_dflash

    g = torch.Generator().manual_seed(0)
    k = torch.randn(3, 5, 2, 32, generator=g)  # [L, n, kv_heads, head_dim]
    w = torch.rand(3, 32, generator=g) + 0.5  # [L, head_dim], distinct per layer
    unit = k * torch.rsqrt(k.pow(2).mean(-1, keepdim=True) + 1e-6)
    out = torch.empty_like(k)
    ops.rms_norm(out, k, w, 1e-6)
    torch.testing.assert_close(out, unit * w[0])  # the bug: layer 0's weight everywhere
    assert not torch.allclose(out, unit * w[:, None, None, :], atol=1e-2)

    class _Layers:
        _k_norm_weights, _rms_norm_eps = w, 1e-6

    torch.testing.assert_close(vllm_dflash.normalize_context_k(_Layers(), k), unit * w[:, None, None, :])
    vllm_dflash.install_dflash_k_norm_fix()
    assert qwen3_dflash.DFlashQwen3Model._normalize_context_k is vllm_dflash.normalize_context_k


def test_dflash_live_publish_serves_exactly_the_published_draft(world: World,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """An engine at tensor parallel 2 (the GPU launchers' setting) started from an UNTRAINED DFlash
    draft, then the trained one published live (bucket by bucket, the worker extension's layer-wise
    reload in each rank's worker): vLLM must then draft exactly what the reference drafts with the
    trained model, and decode what plain decoding does. Before `_rebuild_dflash_buffers` the first
    step after the publish failed ("size mismatch ... vec (0)": DFlash's fused context K/V buffer
    was built from the placeholders of the reload); while it stacked the whole checkpoint's k/v rows
    each rank got both kv heads' rows where vLLM reshapes with its one local head. A second publish
    of the untrained draft must bring back the untrained counters (the buffers follow every version).
    vllm-cpu runs the 2 ranks as spawned worker processes, each bound to one core (its automatic
    binding wants a NUMA node per rank)."""
    _need("dflash")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")
    from verl_speco.engines import vllm_engine, vllm_reload
    from verl_speco.online.publish import write_version

    r = world.served("dflash")
    family, cfg = r["family"], r["cfg"]
    torch.manual_seed(7)
    untrained = family.build(cfg, world.head)
    start = family.export(untrained, cfg, world.spec, world.root / "dflash_untrained")
    _, untrained_ref = world.reference(family.proposer(untrained.eval(), world.spec))
    assert untrained_ref != r["ref"]  # the publish is visible in the counters
    fmt = family.engine_format(cfg, world.spec)
    versions = world.root / "dflash_versions"
    llm = vllm_engine.build_llm(world.target, start, method="dflash", num_speculative_tokens=K,
                                worker_extension_cls=vllm_reload.DRAFT_EXTENSION, tensor_parallel_size=2)
    try:
        seen = []
        for version, model in ((1, r["model"]), (2, untrained)):
            pub = write_version(versions, version, fmt.engine_tensors(model.state_dict()), bucket_bytes=32 << 10)
            assert pub.num_buckets > 1  # the receiver loads bucket by bucket
            answers = vllm_reload.publish_draft(llm, pub.path, pub.version)
            assert [a["status"] for a in answers] == ["loaded", "loaded"], answers  # one answer per rank
            outputs, m = greedy_run(llm)
            assert outputs == world.baseline
            seen.append(vllm_counts(m))
    finally:
        vllm_engine.shutdown(llm)
    print(f"dflash live publish: trained {seen[0]} (reference {r['ref']}), untrained {seen[1]} "
          f"(reference {untrained_ref})")
    assert seen == [r["ref"], untrained_ref]


def test_peagle_mask_token_shifted_by_one_breaks_parity(world: World) -> None:
    _need("peagle")
    r = world.served("peagle")
    shifted_cfg = dataclasses.replace(r["cfg"], mask_token_id=94)  # trained with 95
    shifted = r["family"].export(r["model"], shifted_cfg, world.spec, world.root / "peagle_mask_shifted")
    assert json.loads((shifted / "config.json").read_text())["ptd_token_id"] == 94
    _, planted = world.reference(r["family"].proposer(_load(world, "peagle", shifted), world.spec))
    print(f"peagle mask token 95 exported as 94: reference {planted}, vLLM (correct export) {r['vllm']}")
    assert planted != r["vllm"]


def test_peagle_swapped_plain_layer_norms_break_parity(world: World) -> None:
    _need("peagle")
    r = world.served("peagle")
    bad = _copy_export(r["draft"], world.root / "peagle_norms_swapped")
    tensors = load_file(str(bad / "model.safetensors"))
    a, b = "layers.1.input_layernorm.weight", "layers.1.post_attention_layernorm.weight"
    assert not torch.equal(tensors[a], tensors[b])
    tensors[a], tensors[b] = tensors[b], tensors[a]
    tensors["layers.1.hidden_norm.weight"] = tensors[a].clone()  # the twin follows (the export check needs it)
    save_file(tensors, str(bad / "model.safetensors"))
    _, swapped = world.reference(r["family"].proposer(_load(world, "peagle", bad), world.spec))
    print(f"peagle {a} <-> {b}: reference {swapped}, vLLM (correct export) {r['vllm']}")
    assert swapped != r["vllm"]
