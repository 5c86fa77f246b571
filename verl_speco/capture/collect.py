"""``verl-speco-collect``: fill a Feature Store from a JSONL chat dataset with an HF target.

    verl-speco-collect --target DIR --data chats.jsonl --store STORE --layout-of eagle3 --generate

Captured: the union of the named families' layouts (``--layout-of eagle1,eagle3``: one store trains
each of them) or explicit internal ids (``--layer-ids 1,2,4,5``), recorded in the store's schema.
Each process (rank r of ``WORLD_SIZE`` takes rows r, r+n, ...) checks the dataset (errors name
``file:line``), loads the target, optionally generates the responses, tokenizes with the chat template
(loss mask on the response), runs length-sorted batched forwards with capture hooks and writes one
record per sample. Bad input is one line ``verl-speco-collect: error: ...`` and exit status 2."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from feature_store.schema import ENCODINGS
from verl_speco.capture.chat import (
    TokenizedChat,
    encode_prompt,
    join_generated,
    load_chats,
    prompt_messages,
    tokenize_chat,
)
from verl_speco.capture.generate import generate_responses, generate_responses_vllm
from verl_speco.capture.hooks import FeatureCapture
from verl_speco.capture.records import (
    LengthFilter,
    batch_records,
    build_schema,
    family_names,
    load_families,
    pad_batch,
    resolve_layout,
)
from verl_speco.engines.vllm_engine import ENGINE_DTYPES

Progress = Callable[[str, int, int], None]  # (phase, done, total): `collect_features`' progress
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}
VLLM_OPTIONS = {"dtype": "--engine-dtype", "enforce_eager": "--enforce-eager", "max_num_seqs": "--max-num-seqs"}


@dataclass
class CollectSummary:
    store: str
    rank: int
    world_size: int
    rows: int                  # dataset rows this process handled
    samples: int               # records written by this process
    tokens: int
    response_tokens: int
    seconds: float
    layer_ids: tuple[int, ...]
    truncated: int             # cut to max_length
    dropped_short: int         # fewer than min_response_tokens response tokens
    unfinished: int            # generated responses that hit max_new_tokens


class _Counter:
    """Counts one phase's finished items for a `Progress` callback (reports 0 of `total` at once)."""

    def __init__(self, progress: Progress | None, phase: str, total: int) -> None:
        self.progress, self.phase, self.total, self.done = progress, phase, total, 0
        if progress is not None:
            progress(phase, 0, total)

    def __call__(self, n: int) -> None:
        self.done = min(self.total, self.done + n)
        if self.progress is not None:
            self.progress(self.phase, self.done, self.total)


def end_token_ids(model: nn.Module, tokenizer: Any) -> list[int]:
    """End-of-turn ids: the union of the generation config's, the model config's and the tokenizer's eos."""
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), getattr(model, "config", None), tokenizer):
        eos = getattr(source, "eos_token_id", None)
        ids.update([eos] if isinstance(eos, int) else (eos or []))
    if not ids:
        raise ValueError("end_token_ids: neither the target nor its tokenizer defines eos_token_id")
    return sorted(ids)


@torch.no_grad()
def forward_records(model: nn.Module, chats: Sequence[TokenizedChat], layer_ids: Sequence[int], *,
                    pad_id: int, dtype: torch.dtype = torch.bfloat16,
                    last_hidden: bool = True) -> list[dict[str, torch.Tensor]]:
    """One padded forward over ``chats`` with capture hooks -> per-sample records (see records.py).
    Runs the decoder body only (``model.base_model``): no ``[B, T, V]`` logits are materialized."""
    body = getattr(model, "base_model", model)
    device = next(model.parameters()).device
    ids, mask = pad_batch(chats, pad_id)                     # [B, T_pad] each
    with FeatureCapture(body, layer_ids, last_hidden=last_hidden, dtype=dtype, device="cpu") as cap:
        body(input_ids=ids.to(device), attention_mask=mask.to(device), use_cache=False)
        feats = cap.pop()
    return batch_records(chats, feats)


_EXPECTED_TARGET = "expected an HF model directory (config.json, weights, tokenizer) or a hub id"


def check_target(target: str | Path) -> bool:
    """True for a local model directory, False for a hub id (``org/name``); anything else (a path
    that does not exist, a directory without config.json) raises naming it."""
    path = Path(target)
    if path.exists():
        if not (path / "config.json").is_file():
            raise ValueError(f"--target {str(target)!r}: not a model directory (no config.json); "
                             f"{_EXPECTED_TARGET}")
        return True
    text = str(target)
    if text.startswith(("/", ".", "~")) or text.count("/") != 1:
        raise ValueError(f"--target {text!r}: no such directory; {_EXPECTED_TARGET}")
    return False


def _load(target: str | Path, what: str, load: Callable[[], Any]) -> Any:
    """``load()``, with a failure reported against ``--target`` (a bad or partial model directory)."""
    from safetensors import SafetensorError

    try:
        return load()
    except (OSError, ValueError, SafetensorError) as e:
        detail = " ".join(str(e).split())
        raise ValueError(f"--target {str(target)!r}: cannot load the {what} ({type(e).__name__}: {detail[:300]}); "
                         f"{_EXPECTED_TARGET}") from e


def _rank_world(rank: int | None, world_size: int | None) -> tuple[int, int]:
    rank = int(os.environ.get("RANK", 0)) if rank is None else rank
    world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank}, world_size={world_size}: expected 0 <= rank < world_size")
    return rank, world_size


def collect_features(target: str | Path, data: str | Path, store: str | Path, *,
                     layer_ids: Sequence[int] | None = None, families: str | Sequence[str] | None = None,
                     generate: bool = False, max_new_tokens: int = 256, temperature: float = 0.0,
                     dtype: str = "bfloat16", batch_size: int = 8, max_samples: int | None = None,
                     max_length: int | None = None, min_response_tokens: int = 1, seed: int = 0,
                     last_hidden: bool | None = None, target_model_id: str | None = None,
                     rank: int | None = None, world_size: int | None = None, device: str = "cpu",
                     model: nn.Module | None = None, tokenizer: Any = None,
                     engine: str = "hf", encoding: str = "raw",
                     vllm_options: Mapping[str, Any] | None = None,
                     progress: Progress | None = None) -> CollectSummary:
    """Fill ``store`` from the JSONL chats in ``data`` (see the module docstring).

    ``families``: one or several drafter families whose layouts' union is captured (explicit
    ``layer_ids`` win). ``engine`` generates the responses with ``generate``: "hf" or "vllm" (a local
    target directory; ``vllm_options`` go to ``vllm_engine.build_llm``). ``encoding``: "raw" or
    "fp8_e4m3" (about half of bf16's bytes). ``model``/``tokenizer`` may be passed already loaded."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from feature_store import StoreWriter

    t0 = time.perf_counter()
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}: expected one of {sorted(DTYPES)}")
    if encoding not in ENCODINGS:
        raise ValueError(f"encoding={encoding!r}: expected one of {list(ENCODINGS)}")
    if batch_size < 1:
        raise ValueError(f"batch_size={batch_size}: expected >= 1")
    if engine not in ("hf", "vllm"):
        raise ValueError(f"engine={engine!r}: expected 'hf' or 'vllm'")
    unknown = sorted(set(vllm_options or {}) - set(VLLM_OPTIONS))
    if unknown:
        raise ValueError(f"vllm_options: got {unknown}, expected keys among {list(VLLM_OPTIONS)}")
    if vllm_options and not (generate and engine == "vllm"):
        raise ValueError(f"{', '.join(VLLM_OPTIONS[k] for k in vllm_options)}: apply to --engine vllm with "
                         f"--generate, got --engine {engine}{'' if generate else ' without --generate'}")
    rank, world_size = _rank_world(rank, world_size)
    chats = load_chats(data, max_samples)[rank::world_size]  # first: the data fails fast, the model loads slowly
    if not layer_ids:
        load_families(families)                             # an unknown family fails before the model loads
    torch.manual_seed(seed)
    if tokenizer is None or model is None:
        check_target(target)
    if tokenizer is None:
        tokenizer = _load(target, "tokenizer", lambda: AutoTokenizer.from_pretrained(target))
    if model is None:
        loaded: Any = _load(target, "model",
                            lambda: AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32))
        model = loaded.to(device)
    model.eval()
    hf_config: Any = model.config
    config: Any = getattr(hf_config, "text_config", None) or hf_config
    layout, required = resolve_layout(layer_ids, families, hf_config.to_dict(), last_hidden)
    layers, want_last = layout.layer_ids, layout.last_hidden != "none"
    end_ids = end_token_ids(model, tokenizer)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else end_ids[0]

    unfinished = 0
    if generate:
        prompts = [encode_prompt(tokenizer, prompt_messages(c)) for c in chats]
        answered = _Counter(progress, "generate", len(prompts))
        if engine == "vllm":
            outs = generate_responses_vllm(str(target), prompts, end_ids=end_ids, max_new_tokens=max_new_tokens,
                                           temperature=temperature, seed=seed + rank, on_done=answered,
                                           **(vllm_options or {}))
        else:
            outs = generate_responses(model, prompts, end_ids=end_ids, pad_id=pad_id,
                                      max_new_tokens=max_new_tokens, temperature=temperature,
                                      batch_size=batch_size, seed=seed + rank, on_done=answered)
        unfinished = sum(not o.finished for o in outs)
        tokenized = [join_generated(p, o.response_ids) for p, o in zip(prompts, outs)]
    else:
        tokenized = [tokenize_chat(tokenizer, c, end_ids) for c in chats]
    length_filter = LengthFilter(min_response_tokens=min_response_tokens, max_length=max_length)
    filtered = [length_filter.apply(chat, i) for i, chat in enumerate(tokenized)]
    kept = [chat for chat in filtered if chat is not None]
    kept.sort(key=lambda c: -len(c.input_ids))               # length-sorted batches pad little

    # a stable id whatever the working directory: the target directory's name (or the hub id)
    local = Path(target).is_dir()
    model_id = target_model_id or (Path(target).resolve().name if local else str(target))
    schema = build_schema(layout, config.hidden_size, config.vocab_size, model_id, DTYPES[dtype], encoding)
    missing = [f for f in required if f not in schema.names]
    if missing:
        raise ValueError(f"--layout-of {','.join(family_names(families))}: the families need fields {missing} "
                         f"that capture does not produce "
                         f"(it writes {list(schema.names)})")
    producer = {"tool": "verl-speco-collect", "target_model_id": model_id, "layer_ids": list(layers),
                "target": str(Path(target).resolve()) if local else str(target),
                "families": ",".join(family_names(families)) or None,
                "generated": generate, "max_new_tokens": max_new_tokens, "temperature": temperature,
                "seed": seed, "data": str(data)}
    tokens = response_tokens = 0
    captured = _Counter(progress, "capture", len(kept))
    # copy_inputs=False: every record is a fresh tensor this loop never touches again (no defensive copy)
    with StoreWriter(store, schema, rank=rank, producer=producer, copy_inputs=False) as writer:
        for start in range(0, len(kept), batch_size):
            batch = kept[start: start + batch_size]
            for record in forward_records(model, batch, layers, pad_id=pad_id, dtype=DTYPES[dtype],
                                          last_hidden=want_last):
                writer.add(record, step=0, policy_version=0)
                tokens += len(record["input_ids"])
                response_tokens += int(record["loss_mask"].sum())
            captured(len(batch))
        writer.end_step(0)
    return CollectSummary(str(store), rank, world_size, len(chats), len(kept), tokens, response_tokens,
                          round(time.perf_counter() - t0, 3), layers, length_filter.truncated,
                          length_filter.dropped_short, unfinished)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="verl-speco-collect", description=__doc__.split("\n\n")[0])
    p.add_argument("--target", required=True,
                   help="named target (embedded, smollm2-135m: built / converted once into the cache) or an "
                        "HF target directory (config, weights, tokenizer)")
    p.add_argument("--data", required=True, help="JSONL chats: {'messages': [...]} (or ShareGPT/prompt rows)")
    p.add_argument("--store", required=True, help="Feature Store directory (created if absent)")
    p.add_argument("--generate", action="store_true", help="generate the assistant turn with the target first")
    p.add_argument("--engine", default="hf", choices=("hf", "vllm"),
                   help="what generates with --generate: transformers (hf) or the target served by vLLM")
    p.add_argument("--engine-dtype", default=None, choices=ENGINE_DTYPES,
                   help="--engine vllm: the engine's dtype (default: float32 on the CPU, bfloat16 on a GPU or NPU)")
    p.add_argument("--enforce-eager", default=None, action=argparse.BooleanOptionalAction,
                   help="--engine vllm: run without CUDA/ACL graphs (default: eager on the CPU only)")
    p.add_argument("--max-num-seqs", type=int, default=None,
                   help="--engine vllm: sequences the engine runs at once (default: 32 on the CPU, vLLM's own "
                        "elsewhere)")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    group = p.add_mutually_exclusive_group()
    group.add_argument("--layer-ids", "--layers", dest="layers",
                       help="internal layer ids (HF hidden_states index) to capture, e.g. 1,2,4,5")
    group.add_argument("--layout-of", "--family", dest="families",
                       help="drafter families whose layouts to capture, their union when several, e.g. eagle3 "
                            "(2, L//2, L-3) or eagle1,eagle3 (one store for both)")
    p.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES), help="stored hidden-state dtype")
    p.add_argument("--encoding", default="raw", choices=ENCODINGS,
                   help="hidden-state storage: raw (--dtype) or fp8_e4m3 (e4m3 + a float32 scale per token, "
                        "read back as --dtype)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-samples", type=int, default=None, help="first N rows of the dataset (all ranks)")
    p.add_argument("--max-length", type=int, default=None, help="cut longer sequences (counted)")
    p.add_argument("--min-response-tokens", type=int, default=1, help="drop (and count) shorter samples")
    p.add_argument("--no-last-hidden", action="store_true", help="do not store last_hidden")
    p.add_argument("--target-model-id", default=None, help="id recorded in the store (default: --target)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="device for the target forward/generation (default cpu)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        layers = [int(x) for x in args.layers.split(",") if x.strip()] if args.layers else None
    except ValueError:
        print(f"verl-speco-collect: error: --layer-ids {args.layers!r}: expected comma-separated integers",
              file=sys.stderr)
        return 2
    if args.max_num_seqs is not None and args.max_num_seqs < 1:
        print(f"verl-speco-collect: error: --max-num-seqs {args.max_num_seqs}: expected >= 1", file=sys.stderr)
        return 2
    given = {"dtype": args.engine_dtype, "enforce_eager": args.enforce_eager, "max_num_seqs": args.max_num_seqs}
    from feature_store import StoreError
    from verl_speco.console import Console
    from verl_speco.target.cache import BuildDigestError
    from verl_speco.target.named import is_named_target, resolve_target
    from verl_speco.target.smollm2 import TargetSourceError

    # on a terminal, a bar per phase (prompts answered, rows captured) on stderr
    console = Console(None, bars=not args.json and sys.stderr.isatty())
    try:
        target = resolve_target(args.target) if is_named_target(args.target) else args.target
        with console.phases("collect:") as progress:
            summary = collect_features(
                target, args.data, args.store, layer_ids=layers, families=args.families,
                generate=args.generate, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                dtype=args.dtype, batch_size=args.batch_size, max_samples=args.max_samples,
                max_length=args.max_length, min_response_tokens=args.min_response_tokens, seed=args.seed,
                last_hidden=False if args.no_last_hidden else None, target_model_id=args.target_model_id, device=args.device,
                engine=args.engine, encoding=args.encoding,
                vllm_options={k: v for k, v in given.items() if v is not None}, progress=progress)
    except (ValueError, OSError, StoreError, TargetSourceError, BuildDigestError) as e:
        print(f"verl-speco-collect: error: {' '.join(str(e).split())}", file=sys.stderr)
        return 2
    if summary.rows and summary.dropped_short == summary.rows and not args.generate:
        print("verl-speco-collect: warning: every row was dropped for a short response; prompt-only rows "
              "need --generate", file=sys.stderr)
    if args.json:
        print(json.dumps(asdict(summary)))
    else:
        s = summary
        print(f"verl-speco-collect: rank {s.rank}/{s.world_size}: {s.rows} rows -> {s.samples} samples, "
              f"{s.tokens} tokens ({s.response_tokens} response) in {s.seconds:.2f} s -> {s.store} "
              f"(layers {list(s.layer_ids)}); "
              f"dropped {s.dropped_short} short, truncated {s.truncated}, unfinished generations {s.unfinished}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
