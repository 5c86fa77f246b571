"""Two named checks of the device check (benchmarks/device_checks.py) on the online drafter's path.

- `capture_wait`: `OnlineCapture.collect` copies the kept rows to pinned host memory without blocking
  and returns an event recorded after the copies (verl_speco/online/capture.py `copies_done_event`).
  With the device's stream kept busy first, on an accelerator the copies must still be in flight when
  `collect` returns (the event not yet done: otherwise nothing here proves that waiting matters), and
  the rows `to_bytes()` serialises must equal the same rows cut on the host from a synchronous copy.
  On the CPU there is nothing in flight: no event, the same rows.
- `online_round`: a `DrafterSession` (EAGLE-3 at the check's shapes, a target written to a temporary
  directory) trains one round of 4 optimizer steps on one policy version. On an accelerator its
  linear layers must compute in bfloat16 over float32 weights (FSDP2 mixed precision), and the target
  head snapshot ([V, H] embed and lm_head) must be moved to the device once (2 moves), not once per
  step (2 * (4 + 1)); the losses finite, the weights changed. On the CPU: float32 throughout.
Shapes: capture rows [T, k*H] aux and [T, H] last hidden; the target head [V, H] (V = --vocab).
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path
from typing import Any, ClassVar

import torch
from safetensors.torch import save_file
from torch import Tensor, nn

from verl_speco.capture.hooks import CapturedFeatures
from verl_speco.online.capture import CapturedRows, OnlineCapture
from verl_speco.online.config import CaptureCaps, DrafterRunConfig
from verl_speco.online.session import DrafterSession, TargetHeadSnapshot
from verl_speco.train.config import OptimConfig
from verl_speco.train.step import synchronize

ROUND_STEPS = 4


def _busy(device: torch.device, size: int, rounds: int) -> None:
    """Queue `rounds` matrix products on the device's current stream (work the copies queue behind)."""
    x = torch.randn(size, size, device=device)
    for _ in range(rounds):
        x = torch.tanh(x @ x)


def capture_wait(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    b, k, h = 4, 3, args.hidden
    t = min(args.seq_len, 1024, args.vocab // b)
    attention_mask = torch.ones(b, t, dtype=torch.int64)
    loss_mask = (torch.arange(t) >= t // 4).to(torch.int64).expand(b, t).clone()
    input_ids = torch.arange(b * t).reshape(b, t)  # a row's first token names it: row = id // t
    # remove-padding layout [1, B*T, H]: collect slices it on the device without a host-to-device copy
    # (a pageable one would wait for the busy stream and let the copies finish before collect returns)
    g = torch.Generator().manual_seed(args.seed)
    on_device = [torch.randn(1, b * t, h, generator=g).to(device) for _ in range(k + 1)]
    if device.type != "cpu":
        _busy(device, 4096, 40)
    hidden = [(x * 2).bfloat16() for x in on_device]  # queued behind the busy work
    capture = OnlineCapture(tuple(range(k)), CaptureCaps(max_rows=b, max_tokens=b * t, min_response_tokens=1,
                                                         max_seq_len=t), seed=args.seed)
    rows = capture.collect([CapturedFeatures(tuple(range(k)), dict(enumerate(hidden[:k])), hidden[k])],
                           input_ids, attention_mask, loss_mask, 0)
    event: Any = rows._event
    in_flight = event is not None and not bool(event.query())
    back = CapturedRows.from_bytes(rows.to_bytes())  # what crosses to the drafter: after the wait
    on_host = [x[0].cpu() for x in hidden]  # a synchronous copy: [B*T, H] each
    equal = len(back.records) > 0
    for record in back.records:
        start = int(record["input_ids"][0])
        span = slice(start, start + int(record["input_ids"].numel()))
        want = {"input_ids": input_ids.flatten()[span], "aux_hidden": torch.cat([x[span] for x in on_host[:k]], dim=-1),
                "last_hidden": on_host[k][span]}
        equal = equal and all(torch.equal(record[f], w) for f, w in want.items())
    expect_event = device.type != "cpu"
    kind = type(event).__name__ if event is not None else None
    ok = equal and (event is not None) == expect_event and (in_flight or not expect_event)
    return {"ok": ok, "rows": len(back.records), "event": kind, "in_flight_at_return": in_flight, "rows_equal": equal,
            "detail": f"{len(back.records)} rows equal to the device's after the wait: {equal}; event {kind}, copies "
                      f"in flight when collect returned: {in_flight} (expected on {device.type}: {expect_event})"}


class CountedMoves(torch.Tensor):
    """A host tensor whose `.to(...)` calls that change the device are counted."""

    moves: ClassVar[list[tuple[int, ...]]] = []

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **(kwargs or {}))
        if func is torch.Tensor.to and isinstance(out, Tensor) and out.device != args[0].device:
            cls.moves.append(tuple(args[0].shape))
        return out


def _randn(shape: tuple[int, ...], device: torch.device, seed: int) -> Tensor:
    """Normal host tensor drawn on `device` (a CPU generator takes seconds per [V, H] at 8B sizes)."""
    g = torch.Generator(device).manual_seed(seed)
    return torch.randn(shape, generator=g, device=device).cpu()


def _write_target(root: Path, args: argparse.Namespace, device: torch.device) -> None:
    """A target directory with only what the drafter reads: config.json and the bf16 head tensors."""
    v, h = args.vocab, args.hidden
    config = {"model_type": "llama", "vocab_size": v, "hidden_size": h, "num_hidden_layers": 8,
              "num_attention_heads": args.heads, "num_key_value_heads": args.kv_heads,
              "intermediate_size": args.intermediate, "max_position_embeddings": 4096, "torch_dtype": "bfloat16"}
    (root / "config.json").write_text(json.dumps(config))
    save_file({"model.embed_tokens.weight": (_randn((v, h), device, args.seed) * 0.02).bfloat16(),
               "lm_head.weight": (_randn((v, h), device, args.seed + 1) * 0.05).bfloat16(),
               "model.norm.weight": torch.ones(h, dtype=torch.bfloat16)}, str(root / "model.safetensors"))


def _host(p: Tensor) -> Tensor:
    """A parameter's full value on the host in float32 (FSDP2 parameters are DTensors)."""
    full = p.full_tensor() if hasattr(p, "full_tensor") else p
    return full.detach().float().cpu().clone()


def online_round(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    t, h = min(args.seq_len, 512), args.hidden
    with tempfile.TemporaryDirectory(prefix="gpu_check_target_") as tmp:
        root = Path(tmp)
        _write_target(root, args, device)
        # the draft keeps the target vocab (the online default); SDPA: flex is the family units' subject
        cfg = DrafterRunConfig(enable=True, settings={"attn_backend": "sdpa"},
                               micro_batch_size=1, train_steps_per_round=ROUND_STEPS, max_staleness=1,
                               publish_dir=str(root / "publish"), optim=OptimConfig(lr=1e-3)).validate()
        session = DrafterSession(cfg, root, device=device)
        g = torch.Generator().manual_seed(args.seed)
        rows = CapturedRows([{"input_ids": torch.randint(0, args.vocab, (t,), generator=g),
                              "loss_mask": torch.ones(t, dtype=torch.uint8),
                              "aux_hidden": torch.randn(t, 3 * h, generator=g), "last_hidden": torch.randn(t, h, generator=g)}
                             for _ in range(2)], 0, {"kept": 2})
        head = TargetHeadSnapshot(0, (_randn((args.vocab, h), device, args.seed + 2) * 0.02).as_subclass(CountedMoves),
                                  (_randn((args.vocab, h), device, args.seed + 3) * 0.05).as_subclass(CountedMoves))
        before = {k: _host(p) for k, p in session.model.named_parameters()}
        dtypes: set[str] = set()
        hooks = [m.register_forward_hook(lambda m, i, o: dtypes.add(str(o.dtype).removeprefix("torch.")))
                 for m in session.model.modules() if isinstance(m, nn.Linear) and m.weight.requires_grad]
        CountedMoves.moves.clear()
        session.add(rows, head)
        synchronize(device)
        started = time.perf_counter()
        metrics = session.train_round()
        synchronize(device)
        round_s = time.perf_counter() - started
        for hook in hooks:
            hook.remove()
        after = dict(session.model.named_parameters())
        masters = sorted({str(p.dtype).removeprefix("torch.") for p in after.values()})
        changed = any(not torch.equal(before[k], _host(p)) for k, p in after.items() if p.requires_grad)
    moves, loss = len(CountedMoves.moves), float(metrics.get("loss", math.nan))
    compute = ["float32"] if device.type == "cpu" else ["bfloat16"]
    want_moves = 0 if device.type == "cpu" else 2  # a CPU "move" keeps the device: not counted
    ok = sorted(dtypes) == compute and masters == ["float32"] and moves == want_moves and changed and math.isfinite(loss)
    return {"ok": ok, "compute_dtypes": sorted(dtypes), "master_dtypes": masters, "head_moves": moves,
            "steps": ROUND_STEPS, "round_s": round_s, "loss": loss, "trained": changed,
            "detail": f"{ROUND_STEPS} steps in {round_s:.2f} s, linear outputs {sorted(dtypes)} (expected {compute}) "
                      f"over {masters} weights, head moved {moves}x (expected {want_moves}), loss {loss:.3f}"}
