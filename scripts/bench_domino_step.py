"""Domino's training step alone at the DFlash bench shapes (speculators 0.9.0 has no Domino drafter).

`scripts/bench_train_step.py` has no Domino adapter (no reference to compare against); this runs our
side only, with its machinery: the DFlash adapter's synthetic data and target (`make_data`), the
same step (forward + loss, backward, clip_grad_norm_(1.0), AdamW), frozen target copies cast to
`--frozen-dtype`, and the same step peak (the last warmup step: VmHWM minus the resident set before
it, `peak_rss_delta_mb`). Flags are bench_train_step.py's (shapes, dflash / dspark group, run group);
`--shapes qwen3-8b` is not resolved here, pass the shapes explicitly (docs/results/
train_step_qwen3_8b/README.md gives the command). Domino's own sizes: DominoConfig defaults
(GRU 1024, emb_dim 256).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_train_step as bench  # noqa: E402

from benchmarks.train_step_common import autocast, cast_frozen, make_data  # noqa: E402
from benchmarks.train_step_report import SideStats  # noqa: E402
from drafters.domino import FAMILY as DOMINO  # noqa: E402
from drafters.domino.config import DominoConfig  # noqa: E402


def main() -> None:
    args = bench.build_parser().parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    block = args.block_size if args.block_size is not None else DominoConfig.block_size
    gamma = args.loss_gamma if args.loss_gamma is not None else DominoConfig.loss_gamma
    cfg = DominoConfig(num_layers=args.layers, block_size=block, target_layer_ids=tuple(range(args.context_layers)),
                       num_target_features=args.context_layers, loss_gamma=gamma, num_anchors=args.num_anchors,
                       attn_backend="sdpa")
    data = make_data(args, args.context_layers, 2.0)
    model = DOMINO.build(cfg, data.target)
    model.train()
    batch = DOMINO.collate(data.samples)
    del data
    if args.frozen_dtype != "float32":
        cast_frozen(model, args.frozen_dtype)

    def forward_loss() -> torch.Tensor:
        with autocast(args.dtype):
            return DOMINO.objective(model, batch, progress=0.3).loss()

    side = bench.Side(SideStats("ours", sum(p.numel() for p in model.parameters() if p.requires_grad)),
                      model, forward_loss)
    print(f"=== Domino train step: hidden={args.hidden} heads={args.heads} kv_heads={args.kv_heads} "
          f"intermediate={args.intermediate} vocab={args.vocab} seq_len={args.seq_len} layers={args.layers} "
          f"block_size={block} num_anchors={args.num_anchors} loss_gamma={gamma} context_layers={args.context_layers} "
          f"dtype={args.dtype} frozen_dtype={args.frozen_dtype} threads={torch.get_num_threads()} "
          f"trainable={side.stats.trainable:,}", flush=True)
    bench.trim()
    for i in range(max(args.warmup, 1)):
        if i == max(args.warmup, 1) - 1 and not args.no_memory:
            side.stats.peak_mb, side.stats.process_peak_mb = bench.peak_rss_delta_mb(lambda: side.step(record=False))
        else:
            side.step(record=False)
    for _ in range(args.steps):
        side.step(record=True)
    t = side.stats.times
    summary = {k: statistics.median(v) for k, v in t.items() if v}
    print(f"step peak {side.stats.peak_mb} MB, process peak {side.stats.process_peak_mb} MB; median s: "
          + ", ".join(f"{k} {v:.2f}" for k, v in summary.items()))
    print(bench.RESULT_TAG + json.dumps({"stats": side.stats.__dict__}), flush=True)


if __name__ == "__main__":
    main()
