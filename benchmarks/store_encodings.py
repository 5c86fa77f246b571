"""bf16 vs fp8 (e4m3 + a per-token scale) hidden-state storage, for scripts/bench_feature_store.py.

`family_bytes_per_token`: per drafter family, the Feature Store bytes one token takes at a target's
sizes with the family's recipe layout (its layer ids and last hidden), from the schema, and checked
against a real store of `tokens` tokens written at those sizes. `encoding_throughput`: write and
shuffled-read MB/s of the same samples stored both ways, side by side (MB of the bf16 values).
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable
from itertools import islice
from pathlib import Path

import torch

from drafters.common.target import TargetSpec
from drafters.registry import get_family, known_families
from feature_store import Layout, Schema, StoreReader, StoreWriter, standard_schema
from feature_store.schema import ENCODINGS
from feature_store.store import SHARDS_DIR, list_commits


def family_layout(family: str, settings: dict, spec: TargetSpec) -> Layout:
    """The layout `family` reads at `spec` with recipe `settings`."""
    from verl_speco.launchers.recipes import family_config

    fam = get_family(family)
    return fam.required_layout(fam.resolve(family_config(family, settings), spec), spec)


def schema_for(layout: Layout, spec: TargetSpec, encoding: str) -> Schema:
    return standard_schema(layout, hidden_size=spec.hidden_size, vocab_size=spec.vocab_size,
                           target_model_id="bench", hidden_encoding=encoding)


def row_bytes(schema: Schema) -> int:
    """Bytes per token of the per-token fields as stored."""
    return sum(f.stored_row_nbytes for f in schema.fields if f.per_token)


def _samples(schema: Schema, tokens: int, seq: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for start in range(0, tokens, seq):
        t = min(seq, tokens - start)
        s: dict[str, torch.Tensor] = {"input_ids": torch.randint(0, schema.vocab_size or 2, (t,), generator=g),
                                      "loss_mask": torch.ones(t, dtype=torch.uint8)}
        for f in schema.fields:
            if f.name not in s:
                s[f.name] = torch.randn(t, *f.shape, generator=g).to(f.torch_dtype)
        out.append(s)
    return out


def _tensor_bytes(root: Path) -> int:
    """Bytes of the committed shards after their headers (what the tensors take)."""
    import struct

    total = 0
    for c in list_commits(root):
        path = root / SHARDS_DIR / c.shard
        with open(path, "rb") as f:
            total += path.stat().st_size - 8 - struct.unpack("<Q", f.read(8))[0]
    return total


def family_bytes_per_token(spec: TargetSpec, settings_of: Callable[[str], dict], work: Path,
                           tokens: int = 512) -> list[tuple[str, str, int, int, float]]:
    """Rows (family, layer ids, bf16 B/token, fp8 B/token, measured fp8/bf16 on disk)."""
    rows = []
    for family in known_families():
        layout = family_layout(family, settings_of(family), spec)
        per = {}
        measured = {}
        for enc in ENCODINGS:
            schema = schema_for(layout, spec, enc)
            per[enc] = row_bytes(schema)
            root = work / f"bpt-{family}-{enc}"
            with StoreWriter(root, schema) as w:
                for s in _samples(schema, tokens, 256):
                    w.add(s, step=0)
            measured[enc] = _tensor_bytes(root)
            shutil.rmtree(root)
        ids = ",".join(map(str, layout.layer_ids)) + ("+last" if layout.last_hidden != "none" else "")
        rows.append((family, ids, per["raw"], per["fp8_e4m3"], measured["fp8_e4m3"] / measured["raw"]))
    return rows


def encoding_throughput(samples: list[dict[str, torch.Tensor]], layout: Layout, hidden: int, vocab: int,
                        work: Path, repeats: int = 3) -> dict[str, tuple[float, float, int]]:
    """Per encoding: (write MB/s, shuffled-read MB/s, bytes on disk), MB of the samples' bf16 values;
    best of `repeats`, the two encodings alternating."""
    logical = sum(t.numel() * t.element_size() for s in samples for t in s.values())
    best: dict[str, list[float]] = {enc: [1e9, 1e9] for enc in ENCODINGS}
    disk: dict[str, int] = {}
    for rep in range(repeats):
        for enc in ENCODINGS if rep % 2 == 0 else ENCODINGS[::-1]:
            root = work / f"thr-{enc}-{rep}"
            schema = standard_schema(layout, hidden_size=hidden, vocab_size=vocab, target_model_id="bench",
                                     hidden_encoding=enc)
            t0 = time.perf_counter()
            with StoreWriter(root, schema) as w:
                for i, s in enumerate(samples):
                    w.add(s, step=i // 16)
            best[enc][0] = min(best[enc][0], time.perf_counter() - t0)
            disk[enc] = sum(p.stat().st_size for p in root.rglob("*.safetensors"))
            t0 = time.perf_counter()
            with StoreReader(root, seed=rep, prefetch=2, copy=True) as r:
                for _ in islice(r.iter_samples(), len(r)):
                    pass
            best[enc][1] = min(best[enc][1], time.perf_counter() - t0)
            shutil.rmtree(root)
    return {enc: (logical / w / 1e6, logical / r / 1e6, disk[enc]) for enc, (w, r) in best.items()}
