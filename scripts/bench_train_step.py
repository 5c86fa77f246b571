"""Benchmark: our drafter training steps against speculators' at equal shapes (SDPA, eager losses).

Target (issues): per family, ratio = our step time / speculators' step time <= 1.0, goal <= 0.7.
Families: every one speculators 0.9.0 also has and we implement: eagle3, dflash, dspark, peagle
(`benchmarks/train_step_adapters.py`, one adapter each in its `ADAPTERS` table). `--family all`
(default) runs them in one process, one after another, and ends with one table.

One training step = forward + loss, backward, clip_grad_norm_(1.0), AdamW step (speculators'
trainer loop; ours through the family API: `FAMILY.objective(model, batch).loss()`). Per family
both drafts have the same sizes and start from IDENTICAL weights (ours copied into speculators'
by parameter name); the trainable-parameter counts of both sides are printed. Before timing, a
loss check runs both sides on the same rows (EAGLE-3: the same batch; DFlash / DSpark: the same
batch and the same anchors; P-EAGLE: the same batch and the same COD elements) and prints both
losses and how they relate (the families' semantic differences, documented per adapter; summary
below).

Speculators is a benchmark-only reference (docs/design/environment.md section 1): built from config
objects, verifier name None (nothing downloaded), its verifier embed / lm_head / norm loaded from
our synthetic target. Its CUDA-only defaults are switched to the paths it offers for other
hardware: `_attn_implementation="sdpa"` (default "simple_flex_attention" compiles flex attention;
flex attention's backward does not run on CPU in torch 2.13; with sdpa its DFlash-family and
P-EAGLE masks are dense bool masks from flex's `create_mask`), and the "eager" losses (the fused ones are Triton
kernels). `torch.compile` of its forward is only applied on CUDA (`conditional_torch_compile`).

Semantic differences (details and the numbers in each adapter's docstring and loss check):
- eagle3: speculators trains KL(p || q), ours the soft CE(p, q) = KL + H(p); our loss mask also
  drops rows whose target argmax is outside the draft vocab (fed to speculators as its mask);
  the draft lm_head is trained on both sides (speculators' default freezes it; --frozen-lm-head).
- dflash: ours CE against the data tokens, speculators "ce" against the target argmax (equal on
  this synthetic data; counted); ours normalises by the slot-weight sum, speculators by the row
  count (theirs = ours * sum(w) / N); same exp(-(k - 1) / gamma) slot weights (speculators'
  DFlash recipe default D-PACE is not used); our lm_head runs on the counted rows only.
- dspark: ours 0.1 CE + 0.9 L1 + 1.0 BCE(conf, 1 - L1/2); speculators '{"ce": 0.1, "tv": 1.8}'
  + 1.0 BCE(conf, 1 - TV) with TV = L1 / 2: the same terms; normalisation as dflash; ours runs
  the heads on the counted rows only.
- peagle: as eagle3 (soft CE vs KL, our position mask fed as speculators' loss mask, lm_head
  trained on both sides), one count-normalised term over all depths; speculators' default
  trainable embedding is frozen as ours (embed_requires_grad False); each side draws its own COD
  elements in the timed steps (K = --num-depths, r, r_min; the same counts at the default
  shapes), the check feeds both the same elements (speculators' sampler patched).
- dflash / dspark anchors: `--num-anchors` per sequence on both sides (validated to fit the
  sequence, so speculators computes no padding blocks); the timed steps draw independently.
- speculators packs a batch into one row [1, B*T] with document ids; ours pads to [B, T]. With
  --batch 1 (default) the work is identical.
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
    .venv/bin/python scripts/bench_train_step.py                   # all families, default shapes
    .venv/bin/python scripts/bench_train_step.py --family dflash   # one family
    .venv/bin/python scripts/bench_train_step.py --quick           # smoke run (tiny shapes, seconds per family)
    .venv/bin/python scripts/bench_train_step.py --shapes qwen3-8b --threads 2   # Qwen3-8B recipes, below
    .venv/bin/python scripts/bench_train_step.py --shapes qwen3-8b --family dflash --no-ours-alone
    .venv/bin/python scripts/bench_train_step.py --shapes qwen3-8b --no-cpu-fit  # the recipes unreduced (big host)

--shapes qwen3-8b (benchmarks/train_step_shapes.py reads every value from the catalog and prints its
source): QWEN3_8B's hidden 4096, 32/8 heads, intermediate 12288, vocab 151936 (verl_speco/launchers/
recipes.py); per family the gpu recipe of configs/drafter/<family>.yaml (EAGLE-3 / P-EAGLE draft vocab
32000, TTT 7 / decay 0.8; DFlash 5 layers block 16; DSpark 5 layers block 7; P-EAGLE 4 layers, 8 depths),
the rest from the family config defaults (DFlash / DSpark num_anchors 512, loss_gamma 7 / 4, 5 context
layers, Markov rank 256; P-EAGLE COD r 0.7, r_min 0.2); sequence length data.max_seq_len of the family's
Qwen3-8B trainer preset (EAGLE-3: configs/preset/qwen3_8b_eagle3.yaml, 4096), else the trainer default
(DataSection: 2048); bf16 autocast (that preset's run.mixed_precision); one sequence per step, 2 warmup steps
(memory on the second: AdamW state already allocated), 2 timed. Reductions for a 24 GiB 2-core CPU
host (CPU_FIT, printed with their reasons; --no-cpu-fit drops them, explicit flags win): DFlash /
DSpark 1 layer and P-EAGLE 1 layer (weights + grads + AdamW of the recipe's layers do not fit, and
they add equally to both sides), sequence length 1024 for EAGLE-3 / DFlash / DSpark (time per step;
speculators' [rows, V] fp32 logits) with DFlash / DSpark anchors scaled to 256 (the recipe's anchors
per token), frozen target embedding / lm_head copies in bf16 on both sides. Each side runs in its own
subprocess (--isolate: peak memory without the other side resident; the timing is then not
interleaved, the CPU-time column is the load-robust cross-check), then our side alone at the
recipe's full sequence length and anchors (--ours-alone: peak memory only, no check, no timed
steps). The table adds mem_ratio (peak RSS over a step, ours / speculators) against the memory goals
(DFlash, DSpark <= 0.5; EAGLE-3, P-EAGLE <= 0.8); Domino has the 0.5 goal but no speculators
counterpart (printed, not measured).

Measured on the 2 idle cores (load < 0.5; torch 2.13 CPU, speculators 0.9.0; default shapes:
hidden 1024, 16/4 heads, intermediate 2816, vocab 32000, seq 512, batch 1, fp32), 3.6 min:
    .venv/bin/python scripts/bench_train_step.py          # --threads 2
    family  ours ms  spec ms  ratio  CPU ratio  peak MB ours/spec  trainable (both)  verdict
    eagle3   2942.7   4059.3  0.72   0.73       791 / 939          24,383,488        PASS
    dflash   2072.0   2598.0  0.80   0.82       495 / 555          61,616,768        PASS
    dspark   1261.0   1341.7  0.94   0.95       428 / 542          78,002,049        PASS
    peagle   4123.5   4736.8  0.87   0.88       956 / 1077         58,209,280        PASS
  (peagle: 4 layers, K 8, 1474 COD elements per step on both sides.) Under load (load average
  4-8) the same command had printed eagle3 0.66, dflash 0.91, dspark 0.95, peagle 0.84: a loaded
  machine shifts the ratios by up to 0.2, so compare figures from one quiet run.
  Loss checks (same rows; ours / speculators): eagle3 40.6927 soft CE = 39.2287 KL + 1.4640
  entropy; dflash 11.5249 (/ sum w) -> 5.0945 (/ N) = 5.0945; dspark 3.6062 (/ sum w) ->
  1.9243 (/ N) = 1.9243, terms equal to 3e-7; peagle 10.2269 soft CE = 9.8771 KL + 0.3498
  entropy, residual -6e-7, per depth to 2e-6.
  Where the time goes (torch.profiler, --threads 1, one step per side): both sides run the same
  GEMMs (eagle3 171 / 171 mm, 4.84 / 5.17 s; peagle 93 / 91 mm, 5.31 / 5.98 s), so at equal work
  the GEMMs alone put the ratio near 0.68 (eagle3) and 0.7 (peagle): the 0.7 goal is out of
  reach at these shapes without doing less work than speculators. Our gains are in attention:
  eagle3's TTT and peagle's COD mask attend flash over the causal / depth-0 block plus each
  query's own <= K - 1 keys merged by log-sum-exp (common/attention.py, equal to dense SDPA
  forward and backward in float64), where speculators runs flash over dense masks (eagle3 0.30
  vs 1.36 s, peagle 0.56 vs 1.67 s fwd + bwd per step). P-EAGLE history: 1.02 (dense mask,
  under load) -> 0.84 (structured attention, fc over the T positions plus fc(mask_hidden) once,
  under load); on the quiet machine that code measured 1.08 (FAIL): the chain keys laid out
  [B, Hkv, J, Tq, D], repeated over the 4 query heads per kv head and contracted by einsum cost
  1.7 s of strided copies per step; laid out [B, Hkv, Tq, J, D] with the queries grouped by kv
  head (small batched matmuls) the step is 8.1 -> 6.6 s CPU, ratio 0.87. The DFlash gap is
  speculators' extra target head over every block row (its "ce" labels) and its repeat_kv for
  GQA; DSpark runs the same heads on the same rows on both sides (every slot is counted), so the
  ratio is the small overheads speculators adds (TV evaluated twice, repeat_kv). What is left for
  dflash / dspark (SDPA split into context prefix + own block instead of a dense mask, fused
  softmax / CE / L1 over the [N, V] logits) changes floating-point results.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import train_step_shapes as shapes  # noqa: E402
from benchmarks.speculators_ref import use_speculators  # noqa: E402
from benchmarks.train_step_adapters import ADAPTERS  # noqa: E402
from benchmarks.train_step_common import (
    Built,  # noqa: E402
    cast_frozen,  # noqa: E402
)
from benchmarks.train_step_report import Result, SideStats, report_family, report_table  # noqa: E402

QUICK = dict(hidden=128, heads=4, kv_heads=2, intermediate=256, vocab=2048, draft_vocab=512,
             seq_len=64, batch=1, steps=3, warmup=1, threads=1, layers=1, num_anchors=8, context_layers=3,
             markov_rank=32, peagle_layers=2)
RESULT_TAG = "SIDE_RESULT "  # a child (--side ours|speculators) prints its measurements on this line
# what a child is told explicitly; the preset / isolation switches are the parent's
PARENT_ONLY = {"shapes", "cpu_fit", "isolate", "ours_alone", "quick", "help"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--family", choices=(*ADAPTERS, "all"), default="all",
                   help="which family to benchmark; all = every one, one table at the end")
    p.add_argument("--shapes", choices=shapes.SHAPES, default="default",
                   help="default: the flags' defaults below; qwen3-8b: Qwen3-8B sizes and each family's recipe "
                        "(benchmarks/train_step_shapes.py; the header names every value's source and every "
                        "reduction); explicit flags win")
    p.add_argument("--cpu-fit", action=argparse.BooleanOptionalAction, default=True,
                   help="qwen3-8b: apply the reductions that fit a 24 GiB CPU machine (layers, sequence length, "
                        "anchors, bf16 frozen target tensors; printed)")
    p.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=None,
                   help="run each side in its own subprocess (peak memory without the other side resident; "
                        "timing then not interleaved); default: on for qwen3-8b")
    p.add_argument("--ours-alone", action=argparse.BooleanOptionalAction, default=None,
                   help="also measure our peak memory alone (own subprocess, no check, no timing) at the "
                        "recipe's full sequence length and anchors; qwen3-8b only, default on there")
    g = p.add_argument_group("shapes (every family)")
    g.add_argument("--hidden", type=int, default=1024)
    g.add_argument("--heads", type=int, default=16)
    g.add_argument("--kv-heads", type=int, default=4)
    g.add_argument("--intermediate", type=int, default=2816)
    g.add_argument("--vocab", type=int, default=32000)
    g.add_argument("--seq-len", type=int, default=512)
    g.add_argument("--batch", type=int, default=1)
    g.add_argument("--prompt-frac", type=float, default=0.2,
                   help="leading fraction of each sequence with loss_mask 0 (the prompt)")
    g = p.add_argument_group("eagle3 / peagle")
    g.add_argument("--draft-vocab", type=int, default=8192)
    g.add_argument("--ttt-steps", type=int, default=7, help="eagle3")
    g.add_argument("--ttt-decay", type=float, default=0.8, help="eagle3")
    g.add_argument("--frozen-lm-head", action="store_true", help="freeze the draft lm_head on both sides")
    g = p.add_argument_group("peagle")
    g.add_argument("--num-depths", type=int, default=8, help="K, depths drafted per forward (speculators' default)")
    g.add_argument("--cod-ratio", type=float, default=0.7, help="COD ratio r: depth d keeps (n - d) * max(r^d, r_min)")
    g.add_argument("--cod-ratio-min", type=float, default=0.2, help="COD ratio floor r_min")
    g.add_argument("--peagle-layers", type=int, default=4,
                   help="draft decoder layers (fused 2H layer + plain ones; our PEagleConfig default)")
    g = p.add_argument_group("dflash / dspark")
    g.add_argument("--layers", type=int, default=5, help="draft decoder layers (the Qwen3-8B recipe: 5)")
    g.add_argument("--block-size", type=int, default=None, help="rows per block; default: the family config's ("
                   + ", ".join(f"{n} {a.block_size}" for n, a in ADAPTERS.items() if hasattr(a, "block_size")) + ")")
    g.add_argument("--num-anchors", type=int, default=32, help="blocks per sequence per step")
    g.add_argument("--loss-gamma", type=float, default=None, help="slot-weight decay; default: the family config's ("
                   + ", ".join(f"{n} {a.loss_gamma:g}" for n, a in ADAPTERS.items() if hasattr(a, "loss_gamma")) + ")")
    g.add_argument("--context-layers", type=int, default=5, help="target layers fed to fc (m: fc is m*H -> H)")
    g.add_argument("--markov-rank", type=int, default=256, help="dspark Markov head rank")
    g = p.add_argument_group("run")
    g.add_argument("--steps", type=int, default=5, help="timed steps per side")
    g.add_argument("--warmup", type=int, default=2, help="untimed steps per side")
    g.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    g.add_argument("--frozen-dtype", choices=("float32", "bfloat16"), default="float32",
                   help="dtype of the frozen target embedding / lm_head copies on both sides (bfloat16 needs "
                        "--dtype bfloat16)")
    g.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--no-memory", action="store_true", help="skip the peak-memory pass")
    g.add_argument("--no-check", action="store_true", help="skip the loss check")
    g.add_argument("--side", choices=("both", "ours", "speculators"), default="both",
                   help="run one side only in this process (what --isolate / --ours-alone start; prints "
                        f"{RESULT_TAG.strip()} json)")
    g.add_argument("--quick", action="store_true", help=f"smoke run; defaults become {QUICK}")
    return p


def explicit_flags(p: argparse.ArgumentParser, argv: list[str] | None) -> set[str]:
    """The dests given on the command line (whatever their value)."""
    probe = argparse.ArgumentParser(add_help=False)
    for action in p._actions:
        if action.option_strings and action.dest != "help":
            kwargs: dict[str, Any] = {"dest": action.dest, "default": argparse.SUPPRESS}
            if action.nargs == 0:
                kwargs["action"] = ("store_true" if isinstance(action, argparse._StoreTrueAction)
                                    else argparse.BooleanOptionalAction)
            probe.add_argument(*action.option_strings, **kwargs)
    return set(vars(probe.parse_known_args(argv)[0]))


def family_args(args: argparse.Namespace, name: str, explicit: set[str], full_length: bool = False
                ) -> tuple[argparse.Namespace, list[str]]:
    """`args` for family `name`: the qwen3-8b preset under explicit flags (header lines), or `args`."""
    if args.shapes == "default":
        return args, []
    settings = shapes.preset(name, args.cpu_fit, full_length)
    fam = argparse.Namespace(**vars(args))
    fam.family = name
    for key, s in settings.items():
        if key not in explicit or (full_length and key in ("seq_len", "num_anchors")):
            setattr(fam, key, s.value)
    given = {k: getattr(args, k) for k in settings if k in explicit and not (full_length and k in ("seq_len",
                                                                                                   "num_anchors"))}
    return fam, shapes.describe(name, settings, given)


def validate(p: argparse.ArgumentParser, args: argparse.Namespace, name: str) -> None:
    """Exit with one message naming the flag, the value and what was expected."""
    checks = [("hidden", args.hidden % args.heads == 0, f"a multiple of --heads={args.heads}"),
              ("heads", args.heads % args.kv_heads == 0, f"a multiple of --kv-heads={args.kv_heads}")]
    checks += [(k, getattr(args, k.replace("-", "_")) >= 1, ">= 1")
               for k in ("hidden", "heads", "kv-heads", "intermediate", "vocab", "seq-len", "batch", "threads")]
    checks.append(("steps", args.steps >= (1 if args.side == "both" else 0),
                   ">= 1" if args.side == "both" else ">= 0 (with --side)"))
    checks.append(("warmup", args.warmup >= 0, ">= 0"))
    checks.append(("prompt-frac", 0.0 <= args.prompt_frac < 1.0, "in [0, 1)"))
    checks.append(("frozen-dtype", args.frozen_dtype == "float32" or args.dtype == "bfloat16",
                   f"float32 with --dtype {args.dtype} (bfloat16 frozen tensors need --dtype bfloat16)"))
    for flag, ok, expected in checks:
        if not ok:
            p.error(f"--{flag}: got {getattr(args, flag.replace('-', '_'))}, expected {expected}"
                    + (f" ({name}, --shapes {args.shapes})" if args.shapes != "default" else ""))
    if (args.hidden // args.heads) % 2:
        p.error(f"--hidden/--heads: head_dim {args.hidden // args.heads} must be even (RoPE)")
    for flag, got, expected in ADAPTERS[name].validate(args):
        p.error(f"--{flag}: got {got}, expected {expected}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The run's arguments; `per_family` / `alone` hold each family's (preset) arguments, `header`
    the preset's lines (every value used and every reduction)."""
    p = build_parser()
    args = p.parse_args(argv)
    explicit = explicit_flags(p, argv)
    if args.quick:  # tiny defaults; flags given explicitly still win
        for key, value in QUICK.items():
            if key not in explicit:
                setattr(args, key, value)
                explicit.add(key)  # the preset does not override them either
    qwen = args.shapes == "qwen3-8b"
    if args.side != "both" and (qwen or args.isolate or args.ours_alone):
        p.error(f"--side: got {args.side}, expected both with --shapes {args.shapes}, --isolate or --ours-alone "
                "(a one-side run takes resolved shapes)")
    if args.ours_alone and not qwen:
        p.error("--ours-alone: got it with --shapes default, expected --shapes qwen3-8b (it runs the recipe's "
                "full sequence length)")
    args.isolate = qwen if args.isolate is None else args.isolate
    args.ours_alone = qwen if args.ours_alone is None else args.ours_alone
    args.parser, args.per_family, args.alone, args.header = p, {}, {}, []
    for name in families(args):
        fam, lines = family_args(args, name, explicit)
        validate(p, fam, name)
        args.per_family[name], args.header = fam, args.header + lines
        if args.ours_alone:
            full, _ = family_args(args, name, explicit, full_length=True)
            full.steps, full.no_check, full.side = 0, True, "ours"
            validate(p, full, name)
            args.alone[name] = full
    return args


def families(args: argparse.Namespace) -> list[str]:
    return list(ADAPTERS) if args.family == "all" else [args.family]


def child_argv(p: argparse.ArgumentParser, ns: argparse.Namespace, family: str, side: str) -> list[str]:
    """Command-line flags that reproduce `ns` (resolved) for a one-side child process."""
    out = ["--family", family, "--side", side]
    for action in p._actions:
        if not action.option_strings or action.dest in PARENT_ONLY | {"side", "family"}:
            continue
        value = getattr(ns, action.dest)
        if isinstance(action, argparse._StoreTrueAction):
            out += [action.option_strings[0]] if value else []
        elif value is not None:
            out += [action.option_strings[0], str(value)]
    return out


# ----------------------------------------------------------------------------- steps and timing

@dataclass
class Side:
    stats: SideStats
    model: torch.nn.Module
    forward_loss: Callable[[], torch.Tensor]
    opt: torch.optim.Optimizer = field(init=False)

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
                self.stats.times[key].append(value)
            self.stats.losses.append(float(loss.detach()))


def trim() -> None:
    """Give freed memory back to the kernel (Linux glibc; a no-op elsewhere)."""
    import ctypes

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def peak_rss_delta_mb(fn: Callable[[], None]) -> tuple[float | None, float | None]:
    """(peak resident set during fn() minus the resident set before it, that peak) in MB (Linux),
    else (None, None)."""
    def status(key: str) -> float:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 1024.0
        raise KeyError(key)

    try:
        trim()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM (peak RSS) to the current RSS
        before = status("VmRSS")
    except (OSError, KeyError):
        fn()
        return None, None
    fn()
    peak = status("VmHWM")
    return peak - before, peak


def run_family(name: str, args: argparse.Namespace) -> Result | None:
    """Build, check, warm up (peak memory), time. With --side ours|speculators only that side is kept
    (the other freed before its first step); it prints its SideStats as json and returns None."""
    adapter = ADAPTERS[name]
    use_speculators()  # both sides are built (the loss check), speculators' from its off-sys.path tree
    torch.manual_seed(args.seed)
    built: Built = adapter.build(args)
    if args.frozen_dtype != "float32":
        cast = cast_frozen(built.ours, args.frozen_dtype) + cast_frozen(built.theirs, args.frozen_dtype)
        print(f"frozen target tensors cast to {args.frozen_dtype}: {cast:,} elements over both sides")
    print(f"\n=== {adapter.label} train step: hidden={args.hidden} heads={args.heads} kv_heads={args.kv_heads} "
          f"intermediate={args.intermediate} vocab={args.vocab} seq_len={args.seq_len} batch={args.batch} "
          f"{built.header} dtype={args.dtype} frozen_dtype={args.frozen_dtype} threads={torch.get_num_threads()} "
          f"steps={args.steps} warmup={args.warmup} prompt_frac={args.prompt_frac} side={args.side}")
    check = built.check() if not args.no_check else None
    sides = [Side(SideStats(n, sum(p.numel() for p in m.parameters() if p.requires_grad)), m, f)
             for n, m, f in (("ours", built.ours, built.ours_loss), ("speculators", built.theirs, built.theirs_loss))
             if args.side in ("both", n)]
    loss_names = built.loss_names
    del built  # a one-side run frees the other side here
    trim()
    for i in range(max(args.warmup, 0 if args.no_memory else 1)):
        for side in sides:  # peak memory: on the last untimed step (an extra one when --warmup 0)
            if not args.no_memory and i == max(args.warmup, 1) - 1:
                side.stats.peak_mb, side.stats.process_peak_mb = peak_rss_delta_mb(
                    functools.partial(side.step, record=False))
            else:
                side.step(record=False)
    for i in range(args.steps):  # interleaved; alternate who goes first (A B, B A, ...)
        for side in (sides if i % 2 == 0 else sides[::-1]):
            side.step(record=True)
    checked = (check.ok, (check.ours, check.theirs)) if check is not None else (None, (math.nan, math.nan))
    if args.side != "both":
        print(RESULT_TAG + json.dumps({"stats": asdict(sides[0].stats), "check_ok": checked[0],
                                       "check_losses": list(checked[1]), "loss_names": list(loss_names)}),
              flush=True)
        return None
    result = Result(name, sides[0].stats, sides[1].stats, checked[0], checked[1])
    report_family(result, loss_names, args)
    return result


def run_side(name: str, ns: argparse.Namespace, side: str) -> dict[str, Any]:
    """One side of `name` in a child process (its output streamed here); its json result."""
    cmd = [sys.executable, str(Path(__file__).resolve()), *child_argv(ns.parser, ns, name, side)]
    print(f"\n--- {name} {side}: own process", flush=True)
    found: dict[str, Any] | None = None
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env={**os.environ}) as proc:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith(RESULT_TAG):
                found = json.loads(line[len(RESULT_TAG):])
            else:
                print(line, end="", flush=True)
    if proc.returncode != 0 or found is None:
        raise RuntimeError(f"{name} {side} child exited {proc.returncode} without a result: {' '.join(cmd)}")
    return found


def run_isolated(name: str, args: argparse.Namespace) -> Result:
    """Both sides of `name`, each in its own process (ours runs the loss check); not interleaved."""
    ours = run_side(name, args, "ours")
    theirs = run_side(name, argparse.Namespace(**{**vars(args), "no_check": True}), "speculators")
    result = Result(name, SideStats(**ours["stats"]), SideStats(**theirs["stats"]),
                    ours["check_ok"], (ours["check_losses"][0], ours["check_losses"][1]), interleaved=False)
    report_family(result, (ours["loss_names"][0], ours["loss_names"][1]), args)
    return result


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.side != "both":  # a child of --isolate / --ours-alone: one family, one side, json out
        run_family(args.family, args.per_family[args.family])
        return 0
    for line in args.header:
        print(line)
    if args.shapes == "qwen3-8b":
        for name, why in shapes.NOT_IN_SPECULATORS.items():
            print(f"[{name}] not measured: {why}")
    results, alone = [], {}
    for name in families(args):
        fam = args.per_family[name]
        if args.isolate:
            results.append(run_isolated(name, fam))
        else:
            result = run_family(name, fam)
            assert result is not None
            results.append(result)
        gc.collect()  # the next family starts without this one's models and batches
        if name in args.alone:
            print(f"\n--- {name}: ours alone at the recipe's full length (seq_len={args.alone[name].seq_len}"
                  f"{'' if 'num_anchors' not in shapes.FAMILY_FIELDS[name] else f', num_anchors={args.alone[name].num_anchors}'})")
            alone[name] = SideStats(**run_side(name, args.alone[name], "ours")["stats"])
    report_table(results, alone)
    bad = [r.family for r in results if not (r.check_ok is not False and r.finite)]
    if bad:
        print(f"loss check failed or non-finite loss: {bad} (see above)")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
