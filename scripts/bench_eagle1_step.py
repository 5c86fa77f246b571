"""EAGLE-1's training step, side by side: the fused head loss vs the checkpointed chunks it replaced
(`--compare head`, the default), or float32 vs bf16 mixed-precision compute (`--compare precision`).

EAGLE-1's probability loss reads the frozen target LM head twice per loss row: on the predicted feature
(the draft logits) and on the true one (the soft targets). At a real vocabulary those two [rows, V]
matmuls dominate the step. The shipped objective runs them through `fused_head_loss`
(drafters/common/fused_head.py: each chunk's logits once, in the forward); the previous path ran them
through `chunked_rows` (drafters/common/chunked_head.py: a checkpoint per chunk, so the backward
recomputes both matmuls before its own one). This bench times both on the same model, batch and noise
draw, interleaved (fused, chunked, then chunked, fused, ...), and prints the median step times and
their ratio. Before timing it checks that both give the same loss and the same gradients.

`--compare precision` times the trainer's two settings of `run.mixed_precision` on the fused path: both
models are wrapped by the trainer's own `apply_fsdp` in a one-process gloo group, one with
`mixed_precision=None` (float32 compute), one with `bfloat16` (bf16 compute; float32 master weights,
gradients and AdamW state), from identical weights. Its check line gives the bf16 loss and gradients'
distance from float32's (rounding, not equality), and the table's base is float32.

One step = objective forward + backward + AdamW step. Default shapes are SmolLM2-135M's (hidden 576,
9 / 3 heads of 64, intermediate 1536, vocab 49152) with a random target head and random features; a
batch of 3 sequences of 600 tokens whose last 27% are under the loss (the share in the self-distilled
ShareGPT stores). The weights are random, so the timings, not the losses, are what carry over.

    nice -n 19 .venv/bin/python scripts/bench_eagle1_step.py              # SmolLM2-135M shapes
    .venv/bin/python scripts/bench_eagle1_step.py --compare precision     # bf16 vs float32
    .venv/bin/python scripts/bench_eagle1_step.py --vocab 4000 --seq 64 --steps 2   # quick
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch import Tensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import drafters.eagle1.objective as objective  # noqa: E402
from drafters.common.chunked_head import chunked_rows  # noqa: E402
from drafters.common.fused_head import RowLoss, fused_head_loss  # noqa: E402
from drafters.common.target import TargetHead, TargetSpec  # noqa: E402
from drafters.eagle1.config import Eagle1Config  # noqa: E402
from drafters.eagle1.model import Eagle1Model  # noqa: E402

PATHS = ("fused", "chunked")
PRECISIONS = ("bfloat16", "float32")  # --compare precision: the table's rows; float32 is the base
Run = tuple[Eagle1Model, Callable[..., tuple[Tensor, tuple[Tensor, ...]]], torch.optim.Optimizer]  # what one row times


def checkpointed_head_loss(hidden: Tensor, target_hidden: Tensor, weight: Tensor, target_weight: Tensor,
                           markov: Tensor | None, bias: Tensor | None, row_loss: RowLoss,
                           chunk_rows: int) -> tuple[Tensor, tuple[Tensor, ...]]:
    """`fused_head_loss`'s contract (no bias) over `chunked_rows`: each chunk's two head matmuls and its loss
    under a checkpoint, recomputed in the backward (EAGLE-1's path before the fused one)."""
    assert markov is None and bias is None

    def terms(h: Tensor, g: Tensor) -> tuple[Tensor, ...]:
        loss, outs = row_loss(h @ weight.T, g @ target_weight.T, 0, int(h.shape[0]))
        return (loss.view(1), *outs)  # one loss per chunk, the per-row outputs

    losses, *outs = chunked_rows(terms, [hidden, target_hidden], chunk_rows)
    return losses.sum(), tuple(outs)


def build(args: argparse.Namespace) -> tuple[Eagle1Model, dict[str, Tensor]]:
    """A random target at the given shapes, a fresh EAGLE-1 draft and one right-padded batch."""
    g = torch.Generator().manual_seed(args.seed)
    spec = TargetSpec(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=30,
                      num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, head_dim=args.hidden // args.heads,
                      intermediate_size=args.intermediate, rope_theta=100000.0, rms_norm_eps=1e-5,
                      max_position_embeddings=8192, model_type="llama", tie_word_embeddings=True)
    embed = torch.randn(args.vocab, args.hidden, generator=g) * 0.05  # [V, H], tied: also the head
    target = TargetHead(spec, embed, embed, torch.ones(args.hidden))
    torch.manual_seed(args.seed)
    model = Eagle1Model(Eagle1Config(attn_backend="sdpa", loss_chunk_rows=args.chunk_rows), target).train()
    b, t = args.batch, args.seq
    loss_mask = torch.zeros(b, t, dtype=torch.long)
    loss_mask[:, int(t * (1 - args.loss_frac)):] = 1  # [batch, seq]: the answer's tokens
    batch = {"input_ids": torch.randint(0, args.vocab, (b, t), generator=g),  # [batch, seq]
             "loss_mask": loss_mask, "attention_mask": torch.ones(b, t, dtype=torch.long),
             "last_hidden": torch.randn(b, t, args.hidden, generator=g)}  # [batch, seq, hidden]
    return model, batch


def run_step(model: Eagle1Model, batch: dict[str, Tensor], head_loss: Callable[..., tuple[Tensor, tuple[Tensor, ...]]],
             optimizer: torch.optim.Optimizer | None, seed: int) -> tuple[float, Tensor, dict[str, Tensor]]:
    """One step with `head_loss` in the objective: (seconds, loss, gradients); the optimizer steps if given."""
    objective.fused_head_loss = head_loss  # type: ignore[assignment]  # this process only: the bench's switch
    try:
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        loss = objective.eagle1_objective(model, batch, torch.Generator().manual_seed(seed)).loss()
        loss.backward()
        if optimizer is not None:
            optimizer.step()
        seconds = time.perf_counter() - t0
    finally:
        objective.fused_head_loss = fused_head_loss
    grads = {n: _full(p.grad).detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return seconds, loss.detach(), grads


def _full(t: Tensor) -> Tensor:
    """A plain tensor of `t`, which FSDP2 makes a DTensor (one shard in a one-process group)."""
    full = getattr(t, "full_tensor", None)
    return full() if full is not None else t


def worst_difference(got: dict[str, Tensor], ref: dict[str, Tensor]) -> float:
    """The largest |got - ref| over all gradients, as a share of that tensor's largest |ref| entry."""
    return max(float((got[n].float() - ref[n].float()).abs().max() / ref[n].abs().max().clamp(min=1e-30))
               for n in ref)


def compare_head(args: argparse.Namespace) -> dict[str, list[float]]:
    """fused vs chunked on one model: the check line, then interleaved timed steps per path."""
    paths = {"fused": fused_head_loss, "chunked": checkpointed_head_loss}
    model, batch = build(args)
    header(args, batch)
    _, loss_f, grads_f = run_step(model, batch, paths["fused"], None, args.seed)
    _, loss_c, grads_c = run_step(model, batch, paths["chunked"], None, args.seed)
    print(f"check: loss fused {float(loss_f):.6f}, chunked {float(loss_c):.6f}; "
          f"largest gradient difference {worst_difference(grads_f, grads_c):.1e} of the tensor's largest entry")
    optimizer = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=1e-5)
    return interleaved(args, {name: (model, paths[name], optimizer) for name in PATHS}, batch)


def compare_precision(args: argparse.Namespace) -> dict[str, list[float]]:
    """float32 vs bf16 compute, each model wrapped by the trainer's `apply_fsdp` (one-process gloo group)."""
    import torch.distributed as dist

    from verl_speco.train.distributed import apply_fsdp

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    models = {}
    for name in PRECISIONS:
        model, batch = build(args)  # the same seed: identical weights and batch
        apply_fsdp(model, torch.device("cpu"), None if name == "float32" else name, reshard_after_forward=True)
        models[name] = model
    header(args, batch)
    _, loss_b, grads_b = run_step(models["bfloat16"], batch, fused_head_loss, None, args.seed)
    _, loss_f, grads_f = run_step(models["float32"], batch, fused_head_loss, None, args.seed)
    print(f"check: loss bfloat16 {float(loss_b):.6f}, float32 {float(loss_f):.6f}; "
          f"largest gradient difference {worst_difference(grads_b, grads_f):.1e} of the tensor's largest entry")
    runs: dict[str, Run] = {
        name: (m, fused_head_loss, torch.optim.AdamW([q for q in m.parameters() if q.requires_grad], lr=1e-5))
        for name, m in models.items()}
    return interleaved(args, runs, batch)


def header(args: argparse.Namespace, batch: dict[str, Tensor]) -> None:
    rows = int(objective.shift_rows(batch).row_mask.sum())  # the objective's own loss rows
    print(f"EAGLE-1 step: vocab {args.vocab}, hidden {args.hidden}, batch {args.batch} x {args.seq}, {rows} loss rows, "
          f"chunk {args.chunk_rows}, {torch.get_num_threads()} threads")


def interleaved(args: argparse.Namespace, runs: dict[str, Run], batch: dict[str, Tensor]) -> dict[str, list[float]]:
    """One untimed warm-up step per entry (AdamW's state, first-call allocations), then `args.steps` timed steps
    each, alternating the order (a, b, then b, a, ...) so drift in the machine's load falls on both."""
    names = list(runs)
    for name in names:
        model, head_loss, optimizer = runs[name]
        run_step(model, batch, head_loss, optimizer, args.seed)
    times: dict[str, list[float]] = {name: [] for name in names}
    for i in range(args.steps):
        for name in names if i % 2 == 0 else names[::-1]:
            model, head_loss, optimizer = runs[name]
            times[name].append(run_step(model, batch, head_loss, optimizer, args.seed + i)[0])
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=49152)
    p.add_argument("--hidden", type=int, default=576)
    p.add_argument("--heads", type=int, default=9)
    p.add_argument("--kv-heads", type=int, default=3)
    p.add_argument("--intermediate", type=int, default=1536)
    p.add_argument("--batch", type=int, default=3)
    p.add_argument("--seq", type=int, default=600)
    p.add_argument("--loss-frac", type=float, default=0.27)
    p.add_argument("--chunk-rows", type=int, default=Eagle1Config.loss_chunk_rows)
    p.add_argument("--steps", type=int, default=6, help="timed steps per path")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--compare", choices=("head", "precision"), default="head",
                   help="head: fused vs checkpointed head loss; precision: bf16 vs float32 compute (fused path)")
    args = p.parse_args()
    times = compare_head(args) if args.compare == "head" else compare_precision(args)
    base = "chunked" if args.compare == "head" else "float32"
    med = {name: statistics.median(v) for name, v in times.items()}
    print(f"{'path':>8} {'median s':>9} {'ratio':>6}")
    for name in med:
        print(f"{name:>8} {med[name]:>9.3f} {med[name] / med[base]:>6.3f}")


if __name__ == "__main__":
    main()
