"""Acceptance of an exported EAGLE-3 drafter: our reference decoder and real vLLM, same prompts.

Both report vLLM's convention (drafters.common.metrics): mean acceptance length
= 1 + accepted / drafts, per-position acceptance = accepted at position i / drafts.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from drafters.common.contract import StoreStats
from drafters.common.metrics import AcceptanceStats
from drafters.common.target import TargetHead
from drafters.common.tokens import cut_at_end
from drafters.eagle3 import FAMILY, Eagle3Config
from drafters.eagle3.export import load_export
from drafters.eagle3.model import Eagle3Model
from verl_speco.engines.spec_metrics import SpecCounters, acceptance_summary

# Model entries an export does not carry: the frozen copy of the target embedding.
NOT_EXPORTED = ("embed_tokens.weight",)


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


def load_eagle3_drafter(export_dir: str | Path, target: TargetHead) -> Eagle3Model:
    """Rebuild the trainable EAGLE-3 model from an export (native or speculators) of `target`."""
    state, cfg = load_export(export_dir, target.spec.num_hidden_layers)
    draft_cfg = Eagle3Config(draft_vocab_size=cfg.draft_vocab_size, num_layers=cfg.num_layers,
                             aux_layer_ids=tuple(cfg.aux_layer_ids), norm_before_residual=cfg.norm_before_residual)
    # The vocab map comes from the export; selecting by t2d only gives the model the right shapes.
    stats = StoreStats(token_counts=state["t2d"].to(torch.float32))
    model = FAMILY.build(draft_cfg, target, stats)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if k not in NOT_EXPORTED]
    if missing or unexpected:
        raise ValueError(f"{export_dir}: export does not match the EAGLE-3 model: missing {missing}, "
                         f"unexpected {unexpected}")
    return model.eval()


def _summary(stats: AcceptanceStats) -> dict[str, Any]:
    """The engine-side summary (`spec_metrics.acceptance_summary`) of reference-decoder stats."""
    return acceptance_summary(SpecCounters(stats.num_drafts, stats.num_draft_tokens, stats.num_accepted,
                                           tuple(stats.accepted_per_pos)))


def reference_acceptance(target_dir: str | Path, export_dir: str | Path, prompts: EvalPrompts, k: int,
                         max_new_tokens: int) -> dict[str, Any]:
    """Greedy chain speculative decoding with `drafters.spec_decode` over every prompt."""
    from transformers import AutoModelForCausalLM

    from drafters.spec_decode import speculative_generate

    target_model = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).eval()
    head = TargetHead.from_pretrained(target_dir)
    proposer = FAMILY.proposer(load_eagle3_drafter(export_dir, head), head.spec)
    total, outputs = AcceptanceStats(), []
    for ids in prompts.token_ids:
        res = speculative_generate(target_model, proposer, torch.tensor(ids), num_speculative_tokens=k,
                                   max_new_tokens=max_new_tokens, eos_token_id=prompts.eos_token_id)
        total = total.merge(res.stats)
        outputs.append(res.token_ids.tolist())
    return {**_summary(total), "outputs": outputs}


def export_untrained_like(export_dir: str | Path, target_dir: str | Path, out_dir: str | Path,
                          seed: int = 0) -> Path:
    """A freshly initialised drafter with the same shapes and vocab map as `export_dir`, exported
    the same way: the baseline a trained drafter must beat."""
    head = TargetHead.from_pretrained(target_dir)
    trained = load_eagle3_drafter(export_dir, head)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        fresh = FAMILY.build(trained.cfg, head, StoreStats(token_counts=trained.t2d.to(torch.float32)))
    fresh.load_state_dict({"d2t": trained.d2t, "t2d": trained.t2d}, strict=False)
    return FAMILY.export(fresh, trained.cfg, head.spec, out_dir)


def vllm_acceptance(target_dir: str | Path, drafts: dict[str, Path], prompts: EvalPrompts, k: int,
                    max_new_tokens: int, reference_outputs: list[list[int]] | None = None) -> dict[str, Any]:
    """Serve the target in vLLM without, then with, each drafter; greedy; vLLM's own counters.

    Returns {draft name: acceptance summary + `lossless` (outputs identical to plain decoding)
    + `matches_reference_outputs`}. One engine at a time: vLLM keeps one metrics registry per process.
    """
    from verl_speco.engines import vllm_engine

    def _cut(seqs: list[list[int]]) -> list[list[int]]:
        return [cut_at_end(s, (prompts.eos_token_id,))[0] for s in seqs]

    llm = vllm_engine.build_llm(target_dir, None)
    try:
        plain = _cut(vllm_engine.generate(llm, prompts.token_ids, max_new_tokens, ignore_eos=False))
    finally:
        vllm_engine.shutdown(llm)
    report: dict[str, Any] = {}
    for name, draft_dir in drafts.items():
        llm = vllm_engine.build_llm(target_dir, draft_dir, method="eagle3", num_speculative_tokens=k)
        try:
            out, metrics = vllm_engine.generate_with_metrics(llm, prompts.token_ids, max_new_tokens,
                                                             ignore_eos=False)
        finally:
            vllm_engine.shutdown(llm)
        spec = _cut(out)
        report[name] = {**metrics, "lossless": plain == spec,
                        "matches_reference_outputs": None if reference_outputs is None else reference_outputs == spec}
    return report
