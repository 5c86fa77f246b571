"""Benchmark: our EAGLE-3 training step against speculators' Eagle3 (same shapes, SDPA, eager loss).

Target (issue): ratio = our step time / speculators' step time <= 1.0, goal <= 0.7.

One training step = forward over `ttt_steps` training-time-test steps + loss, backward,
clip_grad_norm_(1.0), AdamW step (speculators' trainer loop; ours through the family API:
`FAMILY.objective(model, batch).loss()`). Both drafts have one fused 2H decoder layer, the same
hidden / heads / kv heads / intermediate sizes, a draft vocab (d2t/t2d) chosen from the same token
counts, a frozen target embedding, and start from IDENTICAL weights (ours copied into speculators').

Speculators is a benchmark-only reference (shared/design/environment.md): built here from config
objects (Llama decoder layer, `_attn_implementation="sdpa"`, verifier name None so nothing is
downloaded), with its verifier head / norm loaded from our synthetic target, and the "eager"
`kl_div` loss (its fused loss needs Triton/CUDA).

Differences that are semantics, not speed (documented, and checked by the loss comparison):
- speculators trains KL(p || q) = CE(p, q) - H(p); we train the soft cross-entropy CE(p, q)
  (SafeAILab). Per TTT step j: ours_j = speculators_j + masked mean target entropy H_j (exact
  when fed the same rows); the check prints the residual.
- our loss mask also drops rows whose target argmax is outside the draft vocab (algorithms.md
  section 3); speculators takes the loss mask as data, so it is fed that same position mask.
- speculators freezes its lm_head by default; both sides TRAIN it here (as SafeAILab and ours do)
  unless `--frozen-lm-head` freezes it on both sides.
- speculators packs a batch into one row [1, B*T] with document ids (its attention runs over
  B*T keys per step); ours pads to [B, T]. With --batch 1 (default) the work is identical.
- bf16 = torch.autocast("cpu", bfloat16) around forward + loss on both sides (speculators'
  trainer does the same); parameters and AdamW stay float32.

Peak memory: per side, the last warmup step (an extra untimed one with --warmup 0) runs with the
resident set trimmed (malloc_trim) and the kernel's peak RSS (VmHWM) reset through
/proc/self/clear_refs; reported as peak - resident before the step (n/a where the kernel
refuses). With --warmup 1 that step also allocates the AdamW state (same size on both sides).

Timing: warmup steps, then `--steps` timed steps per side, interleaved (ours, speculators, then
speculators, ours, ...); the ratio is of the median wall-clock step times. "step CPU time" is the
process CPU time of a step: a load-robust cross-check on a shared machine with `--threads 1`
(with more threads it also counts OpenMP spin-waiting).

Usage:
    .venv/bin/python scripts/bench_eagle3_train_step.py            # ~10 s CPU per step and side: ~1.5-2 min
                                                                   # on 2 idle cores, longer on a loaded box
    .venv/bin/python scripts/bench_eagle3_train_step.py --quick    # smoke run (tiny shapes)
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import gc
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from drafters.common.contract import StoreStats  # noqa: E402
from drafters.common.target import TargetHead, TargetSpec  # noqa: E402
from drafters.common.vocab import token_counts_from_samples  # noqa: E402
from drafters.eagle3 import FAMILY, Eagle3Config, Eagle3Model  # noqa: E402
from drafters.eagle3.objective import prepare_targets  # noqa: E402

NUM_TARGET_LAYERS = 8  # synthetic target depth: aux layers (2, 4, 5); only the count (3) matters here
QUICK = dict(hidden=128, heads=4, kv_heads=2, intermediate=256, vocab=2048, draft_vocab=512,
             seq_len=64, batch=1, steps=3, warmup=1, threads=1)
GOAL, LIMIT = 0.7, 1.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--intermediate", type=int, default=2816)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--draft-vocab", type=int, default=8192)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--ttt-steps", type=int, default=7)
    p.add_argument("--ttt-decay", type=float, default=0.8)
    p.add_argument("--steps", type=int, default=5, help="timed steps per side")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per side")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--prompt-frac", type=float, default=0.2,
                   help="leading fraction of each sequence with loss_mask 0 (the prompt)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--frozen-lm-head", action="store_true", help="freeze the draft lm_head on both sides")
    p.add_argument("--no-memory", action="store_true", help="skip the peak-memory pass")
    p.add_argument("--quick", action="store_true", help=f"smoke run; defaults become {QUICK}")
    args = p.parse_args(argv)
    if args.quick:  # tiny defaults; flags given explicitly still win
        for key, value in QUICK.items():
            if getattr(args, key) == p.get_default(key):
                setattr(args, key, value)
    checks = [("hidden", args.hidden % args.heads == 0, f"a multiple of --heads={args.heads}"),
              ("heads", args.heads % args.kv_heads == 0, f"a multiple of --kv-heads={args.kv_heads}"),
              ("draft-vocab", 0 < args.draft_vocab <= args.vocab, f"in 1..--vocab={args.vocab}"),
              ("seq-len", args.seq_len >= args.ttt_steps + 2, f">= --ttt-steps + 2 = {args.ttt_steps + 2}")]
    checks += [(k, getattr(args, k.replace("-", "_")) >= 1, ">= 1")
               for k in ("hidden", "heads", "kv-heads", "intermediate", "batch", "ttt-steps", "steps", "threads")]
    checks.append(("warmup", args.warmup >= 0, ">= 0"))
    checks.append(("prompt-frac", 0.0 <= args.prompt_frac < 1.0, "in [0, 1)"))
    for name, ok, expected in checks:
        if not ok:
            p.error(f"--{name}: got {getattr(args, name.replace('-', '_'))}, expected {expected}")
    if (args.hidden // args.heads) % 2:
        p.error(f"--hidden/--heads: head_dim {args.hidden // args.heads} must be even (RoPE)")
    return args


# ----------------------------------------------------------------------------- synthetic data

@dataclass
class Data:
    target: TargetHead
    samples: list[dict[str, torch.Tensor]]  # feature-store samples (ours), T = seq_len each
    pre_norm_last: torch.Tensor  # [B, T, H] pre-final-norm last hidden (speculators applies the norm)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps))


def make_data(args: argparse.Namespace) -> Data:
    """A tiny synthetic target (no hub) and B sequences whose target distribution is peaked on
    the real next token (so the target argmax mostly lies in the draft vocab, as with real data).

    Tokens follow a Zipf law over a random permutation of the vocab; the first `--prompt-frac` of
    each sequence is prompt (loss_mask 0). last_hidden[p] (post-norm) leans towards lm_head[x_{p+1}].
    """
    g = torch.Generator().manual_seed(args.seed)
    h, v, t = args.hidden, args.vocab, args.seq_len
    spec = TargetSpec(vocab_size=v, hidden_size=h, num_hidden_layers=NUM_TARGET_LAYERS,
                      num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                      head_dim=h // args.heads, intermediate_size=args.intermediate, rope_theta=10000.0,
                      rms_norm_eps=1e-6, max_position_embeddings=max(4096, 2 * t), model_type="llama",
                      tie_word_embeddings=False)
    target = TargetHead(spec, torch.randn(v, h, generator=g) * 0.02, torch.randn(v, h, generator=g) * 0.05,
                        1.0 + 0.1 * torch.randn(h, generator=g))
    zipf = 1.0 / (torch.arange(v, dtype=torch.float64) + 2.0)
    token_of_rank = torch.randperm(v, generator=g)
    samples, pre_norm = [], []
    for _ in range(args.batch):
        ids = token_of_rank[torch.multinomial(zipf, t + 1, replacement=True, generator=g)]
        direction = target.lm_head[ids[1:]]  # [T, H]: lean position p towards x_{p+1}
        direction = direction / direction.norm(dim=-1, keepdim=True) * math.sqrt(h)
        pre = 0.3 * direction + torch.randn(t, h, generator=g)  # pre-norm last hidden
        loss_mask = (torch.arange(t) >= int(t * args.prompt_frac)).to(torch.uint8)
        samples.append({"input_ids": ids[:t].long(), "loss_mask": loss_mask,
                        "aux_hidden": torch.randn(t, 3 * h, generator=g),
                        "last_hidden": rms_norm(pre, target.final_norm, spec.rms_norm_eps)})
        pre_norm.append(pre)
    return Data(target, samples, torch.stack(pre_norm))


# ----------------------------------------------------------------------------- the two models

def build_ours(args: argparse.Namespace, data: Data) -> tuple[Eagle3Model, dict[str, torch.Tensor]]:
    cfg = Eagle3Config(draft_vocab_size=args.draft_vocab, ttt_steps=args.ttt_steps, ttt_decay=args.ttt_decay,
                       attn_backend="sdpa", lm_head_init="target")
    counts = token_counts_from_samples(data.samples, args.vocab)
    model = FAMILY.build(cfg, data.target, StoreStats(token_counts=counts))
    assert isinstance(model, Eagle3Model)
    if args.frozen_lm_head:
        model.lm_head.weight.requires_grad_(False)
    return model.train(), FAMILY.collate(data.samples)


def build_speculators(args: argparse.Namespace, ours: Eagle3Model, data: Data) -> torch.nn.Module:
    """speculators' Eagle3DraftModel with our sizes and a copy of our weights (no files, no hub)."""
    from speculators.config import SpeculatorsConfig, VerifierConfig
    from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
    from speculators.proposals.greedy import GreedyTokenProposalConfig
    from transformers import LlamaConfig

    spec = data.target.spec
    layer_cfg = LlamaConfig(vocab_size=spec.vocab_size, hidden_size=spec.hidden_size,
                            intermediate_size=spec.intermediate_size, num_hidden_layers=1,
                            num_attention_heads=spec.num_attention_heads,
                            num_key_value_heads=spec.num_key_value_heads, head_dim=spec.head_dim,
                            rms_norm_eps=spec.rms_norm_eps, rope_theta=spec.rope_theta,
                            max_position_embeddings=spec.max_position_embeddings)
    layer_cfg._attn_implementation = "sdpa"
    assert ours.cfg.aux_layer_ids is not None
    cfg = Eagle3SpeculatorConfig(
        transformer_layer_config=layer_cfg, draft_vocab_size=args.draft_vocab,
        eagle_aux_hidden_state_layer_ids=list(ours.cfg.aux_layer_ids),
        speculators_config=SpeculatorsConfig(
            algorithm="eagle3", default_proposal_method="greedy",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=args.ttt_steps)],
            verifier=VerifierConfig(name_or_path=None, architectures=["LlamaForCausalLM"])))
    model = Eagle3DraftModel(cfg)
    model.load_vocab_mappings(ours.t2d.clone(), ours.d2t.clone())
    state = {("layers.0." + k[len("midlayer."):] if k.startswith("midlayer.") else k): v
             for k, v in ours.state_dict().items() if k not in ("d2t", "t2d")}
    state["verifier_lm_head.weight"] = data.target.lm_head[ours.t2d]
    state["verifier_norm.weight"] = data.target.final_norm
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if k not in ("d2t", "t2d")]
    if missing or unexpected:
        raise RuntimeError(f"speculators weight copy: missing {missing}, unexpected {unexpected}")
    model.lm_head.weight.requires_grad_(not args.frozen_lm_head)
    return model.train()


def speculators_batch(batch: dict[str, torch.Tensor], pre_norm_last: torch.Tensor,
                      position_mask: torch.Tensor) -> dict[str, torch.Tensor]:
    """Our padded batch -> speculators' packed, pre-shifted row [1, B*T] (its `shift_batch`).

    Row t of ours (step 0): aux f_t, token x_{t+1}, target at position t+1. speculators takes the
    same rows already shifted: input_ids[t] = x_{t+1}, hidden_states[t] = f_t,
    verifier_last_hidden_states[t] = y_{t+1} (pre-norm), loss_mask[t] = mask at t+1; the last
    row of each sequence is zero-filled with loss_mask 0. `position_mask` [B, T] is our
    objective's mask (loss_mask & real & target argmax in draft vocab).
    """
    def shift(x: torch.Tensor) -> torch.Tensor:
        return torch.cat([x[:, 1:], torch.zeros_like(x[:, :1])], dim=1)

    b, t = batch["input_ids"].shape
    return {"input_ids": shift(batch["input_ids"]).reshape(1, b * t),
            "hidden_states": batch["aux_hidden"].reshape(1, b * t, -1),
            "verifier_last_hidden_states": shift(pre_norm_last).reshape(1, b * t, -1),
            "loss_mask": shift(position_mask).reshape(1, b * t),
            "document_ids": torch.arange(b).repeat_interleave(t)[None]}


# ----------------------------------------------------------------------------- steps and timing

@dataclass
class Side:
    name: str
    model: torch.nn.Module
    forward_loss: Callable[[], torch.Tensor]
    opt: torch.optim.Optimizer = field(init=False)
    times: dict[str, list[float]] = field(
        default_factory=lambda: {"fwd": [], "bwd": [], "opt": [], "step": [], "cpu": []})
    losses: list[float] = field(default_factory=list)
    peak_mb: float | None = None

    def __post_init__(self) -> None:
        self.opt = torch.optim.AdamW([p for p in self.model.parameters() if p.requires_grad], lr=1e-4)

    def step(self, record: bool) -> None:
        c0 = time.process_time()
        t0 = time.perf_counter()
        loss = self.forward_loss()
        t1 = time.perf_counter()
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        t2 = time.perf_counter()
        self.opt.step()
        t3 = time.perf_counter()
        cpu = time.process_time() - c0
        if record:
            for key, value in (("fwd", t1 - t0), ("bwd", t2 - t1), ("opt", t3 - t2), ("step", t3 - t0), ("cpu", cpu)):
                self.times[key].append(value)
            self.losses.append(float(loss.detach()))

    @property
    def trainable(self) -> int:
        return sum(p.numel() for p in self.model.parameters() if p.requires_grad)


def autocast(dtype: str) -> contextlib.AbstractContextManager[object]:
    if dtype == "bfloat16":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def peak_rss_delta_mb(fn: Callable[[], None]) -> float | None:
    """Peak resident set during fn() minus the resident set before it (Linux), else None."""
    try:
        libc = ctypes.CDLL("libc.so.6")
        gc.collect()
        libc.malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM (peak RSS) to the current RSS

        def status(key: str) -> float:
            for line in Path("/proc/self/status").read_text().splitlines():
                if line.startswith(key + ":"):
                    return int(line.split()[1]) / 1024.0
            raise KeyError(key)

        before = status("VmRSS")
    except (OSError, KeyError, AttributeError):
        fn()
        return None
    fn()
    return status("VmHWM") - before


# ----------------------------------------------------------------------------- loss check

def check_losses(args: argparse.Namespace, ours: Eagle3Model, batch: dict[str, torch.Tensor],
                 spec_forward: Callable[[], tuple[torch.Tensor, dict[str, torch.Tensor]]]) -> bool:
    """Same weights, same rows: ours_j (soft CE) - H_j (masked mean target entropy) == speculators_j (KL)."""
    with torch.no_grad(), autocast(args.dtype):
        out = FAMILY.objective(ours, batch)
        spec_loss, metrics = spec_forward()
        targets = prepare_targets(ours, batch)
    ours_steps = (out.numerators / out.denominators.clamp_min(1)).tolist()
    tol = 2e-3 if args.dtype == "float32" else 5e-2
    print(f"loss check (identical weights, before training; {args.dtype}, tolerance {tol} relative):")
    print(f"  {'step':>4} {'rows':>6} {'ours CE':>10} {'target H':>10} {'ours CE-H':>10} {'spec KL':>10} {'diff':>9}")
    ok, weighted_entropy = True, 0.0
    for j in range(args.ttt_steps):
        probs, _, mask = targets.at_step(j)
        ent = -(probs * probs.clamp_min(1e-30).log()).sum(-1)
        rows = float(mask.sum())
        h_j = float((ent * mask).sum()) / max(rows, 1.0)
        weighted_entropy += args.ttt_decay ** j * h_j
        spec_j = float(metrics[f"loss_{j}_sum"]) / args.ttt_decay ** j
        diff = ours_steps[j] - h_j - spec_j
        ok &= abs(diff) <= tol * max(1.0, abs(ours_steps[j]))
        print(f"  {j:>4} {rows:>6.0f} {ours_steps[j]:>10.4f} {h_j:>10.4f} {ours_steps[j] - h_j:>10.4f} "
              f"{spec_j:>10.4f} {diff:>+9.1e}")
    print(f"  total (weights {args.ttt_decay}^j): ours {float(out.loss()):.4f} (soft CE) = speculators "
          f"{float(spec_loss):.4f} (KL) + target entropy {weighted_entropy:.4f}; "
          f"residual {float(out.loss()) - float(spec_loss) - weighted_entropy:+.1e}: {'OK' if ok else 'MISMATCH'}")
    return ok


# ----------------------------------------------------------------------------- main

def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    from speculators.losses import resolve_loss_config

    data = make_data(args)
    ours, batch = build_ours(args, data)
    spec_model = build_speculators(args, ours, data)
    with torch.no_grad():
        position_mask = prepare_targets(ours, batch).position_mask
    spec_batch = speculators_batch(batch, data.pre_norm_last, position_mask)
    loss_config = resolve_loss_config("kl_div", "eager")

    def spec_forward() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        _, loss, metrics = spec_model(**spec_batch, ttt_steps=args.ttt_steps,
                                      ttt_step_loss_decay=args.ttt_decay, loss_config=loss_config)
        return loss, metrics

    def ours_loss() -> torch.Tensor:
        with autocast(args.dtype):
            return FAMILY.objective(ours, batch).loss()

    def spec_loss() -> torch.Tensor:
        with autocast(args.dtype):
            return spec_forward()[0]

    print(f"EAGLE-3 train step: hidden={args.hidden} heads={args.heads} kv_heads={args.kv_heads} "
          f"intermediate={args.intermediate} vocab={args.vocab} draft_vocab={args.draft_vocab} "
          f"seq_len={args.seq_len} batch={args.batch} ttt_steps={args.ttt_steps} dtype={args.dtype} "
          f"threads={torch.get_num_threads()} steps={args.steps} warmup={args.warmup} "
          f"prompt_frac={args.prompt_frac} "
          f"lm_head={'frozen' if args.frozen_lm_head else 'trained'}")
    losses_ok = check_losses(args, ours, batch, spec_forward)

    sides = [Side("ours", ours, ours_loss), Side("speculators", spec_model, spec_loss)]
    for i in range(max(args.warmup, 0 if args.no_memory else 1)):
        for side in sides:  # peak memory: on the last untimed step (an extra one when --warmup 0)
            if not args.no_memory and i == max(args.warmup, 1) - 1:
                side.peak_mb = peak_rss_delta_mb(lambda s=side: s.step(record=False))
            else:
                side.step(record=False)
    for i in range(args.steps):  # interleaved; alternate who goes first (A B, B A, ...)
        for side in (sides if i % 2 == 0 else sides[::-1]):
            side.step(record=True)

    ours_side, spec_side = sides
    med = {s.name: {k: statistics.median(v) * 1e3 for k, v in s.times.items()} for s in sides}
    print(f"\n{'':<28}{'ours':>14}{'speculators':>14}{'ours/spec':>11}")
    for key, label in (("step", "step median (ms)"), ("fwd", "  forward+loss (ms)"),
                       ("bwd", "  backward+clip (ms)"), ("opt", "  AdamW step (ms)"),
                       ("cpu", "step CPU time (ms)")):
        a, b = med["ours"][key], med["speculators"][key]
        print(f"{label:<28}{a:>14.1f}{b:>14.1f}{a / b:>11.2f}")
    for label, fn in (("step min (ms)", lambda s: min(s.times["step"]) * 1e3),
                      ("step max (ms)", lambda s: max(s.times["step"]) * 1e3)):
        print(f"{label:<28}{fn(ours_side):>14.1f}{fn(spec_side):>14.1f}")
    print(f"{'trainable params':<28}{ours_side.trainable:>14,}{spec_side.trainable:>14,}")
    mem = ["n/a" if s.peak_mb is None else f"{s.peak_mb:.0f}" for s in sides]
    if not args.no_memory:
        print(f"{'peak RSS over step (MB)':<28}{mem[0]:>14}{mem[1]:>14}")
    print(f"{'loss first timed step':<28}{ours_side.losses[0]:>14.4f}{spec_side.losses[0]:>14.4f}"
          "   (ours = soft CE, speculators = KL)")
    print(f"{'loss last timed step':<28}{ours_side.losses[-1]:>14.4f}{spec_side.losses[-1]:>14.4f}")
    ratio = med["ours"]["step"] / med["speculators"]["step"]
    verdict = "goal met" if ratio <= GOAL else ("within limit, above goal" if ratio <= LIMIT else "OVER LIMIT")
    print(f"\nratio ours/speculators = {ratio:.2f} (goal <= {GOAL}, must be <= {LIMIT})")
    print(f"verdict: {verdict}")
    if not losses_ok:
        print("loss check: MISMATCH (see table above)")
    return 0 if losses_ok and all(math.isfinite(x) for s in sides for x in s.losses) else 1


if __name__ == "__main__":
    sys.exit(main())
