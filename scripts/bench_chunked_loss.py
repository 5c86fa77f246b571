"""Peak memory and time of the chunked LM head + loss (drafters/common/chunked_head.py) vs unchunked.

The measured loss is EAGLE-3's (the heaviest): a trainable head W [V, H] on draft rows [rows, H], soft
cross-entropy against the target distribution rebuilt from the target's last hidden [rows, H] through
the frozen target head [V, H]; forward + backward (gradients of the rows and of W). Each setting runs
in a fresh subprocess; peak = the process's peak RSS (CPU) or max_memory_allocated (CUDA) during the
loss minus the level before it (inputs, weights). Printed side by side as ratios to unchunked.

    nice -n 19 env OMP_NUM_THREADS=1 python scripts/bench_chunked_loss.py            # rows 4096, vocab 32000, hidden 1024
    python scripts/bench_chunked_loss.py --rows 512 --vocab 4000 --hidden 256 --chunks 64 256   # quick
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time

import torch

from drafters.common.chunked_head import chunked_rows, soft_ce_rows

UNCHUNKED = 0  # the chunk setting meaning "no chunking": the terms on all rows, no checkpoint


def _peak_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux: KiB


def measure(rows: int, vocab: int, hidden: int, chunk: int, device: torch.device, repeats: int) -> dict[str, float]:
    """One setting in this process: {'peak_mb', 'seconds'} (best of `repeats` for the time)."""
    g = torch.Generator().manual_seed(0)
    h = (torch.randn(rows, hidden, generator=g) / hidden ** 0.5).to(device).requires_grad_()  # [rows, H]
    last = torch.randn(rows, hidden, generator=g).to(device)  # [rows, H]
    w = (torch.randn(vocab, hidden, generator=g) / hidden ** 0.5).to(device).requires_grad_()  # [V, H]
    wt = (torch.randn(vocab, hidden, generator=g) / hidden ** 0.5).to(device)  # [V, H] frozen target head

    def terms(x: torch.Tensor, lh: torch.Tensor) -> tuple[torch.Tensor]:
        return (soft_ce_rows(x @ w.T, lh @ wt.T),)  # [n]

    def step() -> None:
        if chunk == UNCHUNKED:
            (ce,) = terms(h, last)
        else:
            (ce,) = chunked_rows(terms, [h, last], chunk)
        ce.sum().backward()
        h.grad = w.grad = None

    tiny = torch.zeros(2, hidden, device=device, requires_grad=True)  # warm-up: lazy imports / kernels, tiny tensors
    chunked_rows(lambda x: (x.sum(-1),), [tiny], 1)[0].sum().backward()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    before = _peak_bytes(device) if device.type == "cuda" else _rss_now()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return {"peak_mb": (_peak_bytes(device) - before) / 2 ** 20, "seconds": best}


def _rss_now() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", type=int, default=4096)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--chunks", type=int, nargs="+", default=[256, 512, 1024, 2048, 4096])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # child: one setting, JSON out
    args = p.parse_args()
    device = torch.device(args.device)
    if args.one is not None:
        print(json.dumps(measure(args.rows, args.vocab, args.hidden, args.one, device, args.repeats)))
        return
    results = {}
    for chunk in [UNCHUNKED, *args.chunks]:
        cmd = [sys.executable, __file__, "--rows", str(args.rows), "--vocab", str(args.vocab), "--hidden",
               str(args.hidden), "--device", args.device, "--repeats", str(args.repeats), "--one", str(chunk)]
        # a fixed mmap threshold: every large tensor is its own mapping, returned to the OS when freed, so RSS
        # follows the live tensors (glibc's dynamic threshold would otherwise keep freed buffers in the heap)
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
        results[chunk] = json.loads(out.strip().splitlines()[-1])
    base = results[UNCHUNKED]
    print(f"rows {args.rows}, vocab {args.vocab}, hidden {args.hidden}, {args.device}, "
          f"{torch.get_num_threads()} threads; soft CE vs rebuilt target, forward + backward")
    print(f"{'chunk':>10} {'peak MB':>9} {'peak ratio':>10} {'seconds':>8} {'time ratio':>10}")
    for chunk, r in results.items():
        name = "unchunked" if chunk == UNCHUNKED else str(chunk)
        print(f"{name:>10} {r['peak_mb']:>9.0f} {r['peak_mb'] / base['peak_mb']:>10.3f} {r['seconds']:>8.2f} "
              f"{r['seconds'] / base['seconds']:>10.3f}")


if __name__ == "__main__":
    main()
