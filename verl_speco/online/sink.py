"""`collect_only` mode: the online capture's rows go to the Feature Store (one writer per rank) that
`verl-speco-draft-train` reads; shards are committed at every step boundary and every `flush_samples` rows."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from feature_store import StoreWriter
from feature_store.schema import ENCODINGS
from verl_speco.capture.records import build_schema, capture_layout
from verl_speco.online.capture import CapturedRows
from verl_speco.online.config import FeatureStoreSink, floating_dtype


class StoreSink:
    """Writes `CapturedRows` of rank `rank` to the store at `cfg.path`. `last_hidden=False`: rows carry
    no `last_hidden` (SGLang's aux rollout capture, `verl_speco.online.rollout_capture`)."""

    def __init__(self, cfg: FeatureStoreSink, layer_ids: tuple[int, ...], hidden_size: int, vocab_size: int,
                 target_model_id: str, rank: int = 0, producer: dict[str, Any] | None = None,
                 last_hidden: bool = True):
        if not cfg.path:
            raise ValueError("actor_rollout_ref.rollout.drafter.feature_store.path: got None, expected a store "
                             "directory for collect_only mode")
        dtype = floating_dtype(cfg.hidden_dtype, "actor_rollout_ref.rollout.drafter.feature_store.hidden_dtype")
        if cfg.hidden_encoding not in ENCODINGS:
            raise ValueError(f"actor_rollout_ref.rollout.drafter.feature_store.hidden_encoding: got "
                             f"{cfg.hidden_encoding!r}, expected one of {list(ENCODINGS)}")
        self.dtype = dtype
        schema = build_schema(capture_layout(layer_ids, last_hidden), hidden_size, vocab_size, target_model_id, dtype,
                              cfg.hidden_encoding)
        # copy_inputs=False: captured rows are fresh tensors nobody mutates after `write` (no defensive copy)
        self.writer = StoreWriter(Path(cfg.path), schema, rank=rank, flush_samples=cfg.flush_samples, copy_inputs=False,
                                  producer={"tool": "verl-speco online collect_only", **(producer or {})})
        self.samples = 0
        self.tokens = 0

    def write(self, rows: CapturedRows, step: int) -> None:
        rows.wait()
        for record in rows.records:
            sample = {k: (v.to(self.dtype) if v.is_floating_point() else v) for k, v in record.items()}
            self.writer.add(sample, step=int(step), policy_version=rows.policy_version)
            self.samples += 1
            self.tokens += int(record["input_ids"].numel())

    def end_step(self, step: int) -> None:
        """Commit everything buffered for `step` (call at every RL step boundary)."""
        self.writer.end_step(int(step))

    def close(self) -> None:
        self.writer.close()
