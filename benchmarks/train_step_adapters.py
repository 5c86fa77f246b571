"""Per-family adapters for scripts/bench_train_step.py: our drafter and speculators' at equal shapes.

An adapter builds, for one drafter family, both sides at the same sizes with IDENTICAL weights (ours
copied into speculators' by parameter name), one synthetic batch in each side's layout, the
forward + loss closure of each side, and a loss check that feeds both sides the same rows. The
script owns everything else (timing, interleaving, peak memory, report). A new family is one
more adapter class and one more entry in `ADAPTERS`.

Speculators is a benchmark-only reference (docs/design/environment.md section 1): built from config
objects, verifier name None (nothing downloaded), verifier embed / lm_head / norm loaded from our
synthetic target, `sdpa` attention and the "eager" losses (its defaults, flex attention and the
fused Triton losses, need CUDA; flex attention's backward does not run on CPU).

Each adapter's docstring lists the semantic differences between the two sides; the loss check
prints how they show in the numbers.
"""

from __future__ import annotations

import argparse
import contextlib
import json
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any, ClassVar
from unittest import mock

import torch
from torch import Tensor, nn

import drafters.common.fused_head as fused_head_module
import drafters.dflash.objective as dflash_objective_module
import drafters.dspark.objective as dspark_objective_module
import drafters.peagle.objective as peagle_objective_module
from benchmarks.train_step_common import (
    LOSS_REDUCTION_EPS,
    NUM_TARGET_LAYERS,
    Adapter,
    Built,
    Data,
    LossCheck,
    autocast,
    label_agreement,
    layer_config,
    load_exact,
    make_data,
    speculators_config,
    tolerance,
    verifier_config,
)
from drafters.common.chunked_head import soft_ce_grad_rows
from drafters.common.contract import StoreStats
from drafters.common.losses import ObjectiveOutput
from drafters.common.target import TargetSpec
from drafters.common.vocab import token_counts_from_samples
from drafters.dflash import FAMILY as DFLASH
from drafters.dflash import DFlashConfig, DFlashDraft
from drafters.dflash.family import DFlashFamily
from drafters.dspark import FAMILY as DSPARK
from drafters.dspark import DSparkConfig
from drafters.eagle3 import FAMILY as EAGLE3
from drafters.eagle3 import Eagle3Config, Eagle3Model
from drafters.eagle3.objective import prepare_targets
from drafters.peagle import FAMILY as PEAGLE
from drafters.peagle import PEagleConfig, PEagleModel
from drafters.peagle.cod import CODLayout, cod_sample, document_ids

# ----------------------------------------------------------------------------- EAGLE-3

class Eagle3Adapter(Adapter):
    """EAGLE-3: one fused 2H decoder layer, `ttt_steps` training-time-test steps.

    Both drafts have the same hidden / heads / kv heads / intermediate sizes, a draft vocab
    (d2t/t2d) chosen from the same token counts, a frozen target embedding. Speculators:
    Eagle3DraftModel (Llama decoder layer), loss "kl_div" (eager).
    Differences that are semantics, not speed:
    - speculators trains KL(p || q) = CE(p, q) - H(p); we train the soft cross-entropy CE(p, q)
      (SafeAILab). Per TTT step j: ours_j = speculators_j + masked mean target entropy H_j (exact
      when fed the same rows); the check prints the residual.
    - our loss mask also drops rows whose target argmax is outside the draft vocab
      (docs/design/algorithms.md section 3); speculators takes the loss mask as data, so it is fed that same position mask.
    - speculators freezes its lm_head by default; both sides TRAIN it here (as SafeAILab and ours
      do) unless `--frozen-lm-head` freezes it on both sides.
    - speculators packs a batch into one row [1, B*T] with document ids (its attention runs over
      B*T keys per step); ours pads to [B, T]. With --batch 1 (default) the work is identical.
    """

    name, label = "eagle3", "EAGLE-3"
    lean = 0.3  # mostly (not always) the target argmax is the next token: KL vs CE is exact anyway

    def validate(self, args: argparse.Namespace) -> list[tuple[str, object, str]]:
        bad: list[tuple[str, object, str]] = []
        if not 0 < args.draft_vocab <= args.vocab:
            bad.append(("draft-vocab", args.draft_vocab, f"in 1..--vocab={args.vocab}"))
        if args.ttt_steps < 1:
            bad.append(("ttt-steps", args.ttt_steps, ">= 1"))
        elif args.seq_len < args.ttt_steps + 2:
            bad.append(("seq-len", args.seq_len, f">= --ttt-steps + 2 = {args.ttt_steps + 2} (eagle3)"))
        if not 0 < args.ttt_decay <= 1:
            bad.append(("ttt-decay", args.ttt_decay, "in (0, 1]"))
        return bad

    def build(self, args: argparse.Namespace) -> Built:
        from speculators.losses import resolve_loss_config

        data = make_data(args, 3, self.lean)
        cfg = self.our_config(args)
        ours = EAGLE3.build(cfg, data.target, StoreStats(token_counts=token_counts_from_samples(data.samples,
                                                                                               args.vocab)))
        assert isinstance(ours, Eagle3Model)
        if args.frozen_lm_head:
            ours.lm_head.weight.requires_grad_(False)
        ours.train()
        batch = EAGLE3.collate(data.samples)
        theirs = self._speculators(args, ours, data)
        with torch.no_grad():
            position_mask = prepare_targets(ours, batch).position_mask
        spec_batch = self._speculators_batch(batch, data.pre_norm_last, position_mask)
        loss_config = resolve_loss_config("kl_div", "eager")

        def spec_forward() -> tuple[Tensor, dict[str, Tensor]]:
            _, loss, metrics = theirs(**spec_batch, ttt_steps=args.ttt_steps, ttt_step_loss_decay=args.ttt_decay,
                                      loss_config=loss_config)
            return loss, metrics

        def ours_loss() -> Tensor:
            with autocast(args.dtype):
                return EAGLE3.objective(ours, batch).loss()

        def theirs_loss() -> Tensor:
            with autocast(args.dtype):
                return spec_forward()[0]

        header = (f"draft_vocab={args.draft_vocab} ttt_steps={args.ttt_steps} ttt_decay={args.ttt_decay} "
                  f"lm_head={'frozen' if args.frozen_lm_head else 'trained'}")
        return Built(ours, theirs, ours_loss, theirs_loss, lambda: self._check(args, ours, batch, spec_forward),
                     header, ("soft CE", "KL"))

    def our_config(self, args: argparse.Namespace) -> Eagle3Config:
        return Eagle3Config(draft_vocab_size=args.draft_vocab, ttt_steps=args.ttt_steps, ttt_decay=args.ttt_decay,
                            attn_backend="sdpa", lm_head_init="target")

    @staticmethod
    def _speculators(args: argparse.Namespace, ours: Eagle3Model, data: Data) -> nn.Module:
        """speculators' Eagle3DraftModel with our sizes and a copy of our weights."""
        from speculators.models.eagle3 import Eagle3DraftModel, Eagle3SpeculatorConfig
        from transformers import LlamaConfig

        assert ours.cfg.aux_layer_ids is not None
        cfg = Eagle3SpeculatorConfig(
            transformer_layer_config=layer_config(LlamaConfig, data.target.spec, 1),
            draft_vocab_size=args.draft_vocab, eagle_aux_hidden_state_layer_ids=list(ours.cfg.aux_layer_ids),
            speculators_config=speculators_config("eagle3", args.ttt_steps))
        model = Eagle3DraftModel(cfg)
        model.load_vocab_mappings(ours.t2d.clone(), ours.d2t.clone())
        state = {("layers.0." + k[len("midlayer."):] if k.startswith("midlayer.") else k): v
                 for k, v in ours.state_dict().items() if k not in ("d2t", "t2d")}
        state["verifier_lm_head.weight"] = data.target.lm_head[ours.t2d]
        state["verifier_norm.weight"] = data.target.final_norm
        load_exact(model, state, "speculators eagle3", may_miss=("d2t", "t2d"))  # set by load_vocab_mappings
        model.lm_head.weight.requires_grad_(not args.frozen_lm_head)
        return model.train()

    @staticmethod
    def _speculators_batch(batch: dict[str, Tensor], pre_norm_last: Tensor,
                           position_mask: Tensor) -> dict[str, Tensor]:
        """Our padded batch -> speculators' packed, pre-shifted row [1, B*T] (its `shift_batch`).

        Row t of ours (step 0): aux f_t, token x_{t+1}, target at position t+1. speculators takes
        the same rows already shifted: input_ids[t] = x_{t+1}, hidden_states[t] = f_t,
        verifier_last_hidden_states[t] = y_{t+1} (pre-norm), loss_mask[t] = mask at t+1; the last
        row of each sequence is zero-filled with loss_mask 0. `position_mask` [B, T] is our
        objective's mask (loss_mask & real & target argmax in draft vocab).
        """
        def shift(x: Tensor) -> Tensor:
            return torch.cat([x[:, 1:], torch.zeros_like(x[:, :1])], dim=1)

        b, t = batch["input_ids"].shape
        return {"input_ids": shift(batch["input_ids"]).reshape(1, b * t),
                "hidden_states": batch["aux_hidden"].reshape(1, b * t, -1),
                "verifier_last_hidden_states": shift(pre_norm_last).reshape(1, b * t, -1),
                "loss_mask": shift(position_mask).reshape(1, b * t),
                "document_ids": torch.arange(b).repeat_interleave(t)[None]}

    @staticmethod
    def _check(args: argparse.Namespace, ours: Eagle3Model, batch: dict[str, Tensor],
               spec_forward: Callable[[], tuple[Tensor, dict[str, Tensor]]]) -> LossCheck:
        """Same weights, same rows: ours_j (soft CE) - H_j (masked mean target entropy) == speculators_j (KL)."""
        with torch.no_grad(), autocast(args.dtype):
            out = EAGLE3.objective(ours, batch)
            spec_loss, metrics = spec_forward()
            targets = prepare_targets(ours, batch)
        ours_steps = (out.numerators / out.denominators.clamp_min(1)).tolist()
        tol = tolerance(args.dtype)
        print(f"loss check (identical weights, before training; {args.dtype}, tolerance {tol} relative):")
        print(f"  {'step':>4} {'rows':>6} {'ours CE':>10} {'target H':>10} {'ours CE-H':>10} {'spec KL':>10} "
              f"{'diff':>9}")
        ok, weighted_entropy = True, 0.0
        for j in range(args.ttt_steps):
            b_j, _, prob_rows_j, _ = targets.rows_at_step(j)
            probs = targets.probs[prob_rows_j].float()  # [N_j, Vd]
            ent = -(probs * probs.clamp_min(1e-30).log()).sum(-1)
            rows = float(b_j.numel())
            h_j = float(ent.sum()) / max(rows, 1.0)
            weighted_entropy += args.ttt_decay ** j * h_j
            spec_j = float(metrics[f"loss_{j}_sum"]) / args.ttt_decay ** j
            diff = ours_steps[j] - h_j - spec_j
            ok &= abs(diff) <= tol * max(1.0, abs(ours_steps[j]))
            print(f"  {j:>4} {rows:>6.0f} {ours_steps[j]:>10.4f} {h_j:>10.4f} {ours_steps[j] - h_j:>10.4f} "
                  f"{spec_j:>10.4f} {diff:>+9.1e}")
        total = float(out.loss())
        print(f"  total (weights {args.ttt_decay}^j): ours {total:.4f} (soft CE) = speculators "
              f"{float(spec_loss):.4f} (KL) + target entropy {weighted_entropy:.4f}; "
              f"residual {total - float(spec_loss) - weighted_entropy:+.1e}: {'OK' if ok else 'MISMATCH'}")
        return LossCheck(ok, total, float(spec_loss))


# ----------------------------------------------------------------------------- DFlash family

class DFlashAdapter(Adapter):
    """DFlash: `--layers` Qwen3 layers over [context ; blocks], `--num-anchors` blocks of
    `--block-size` rows per sequence, `--context-layers` target layers through `fc`.

    Both sides: the same backbone (fc, hidden_norm, Qwen3 layers with q/k norms, norm), the frozen
    target embedding for the block inputs and the frozen target lm_head (full vocab, no draft
    vocab); identical trainable parameters (the script prints both counts). Speculators:
    DFlashDraftModel, loss "ce" (eager) with "fixed-exp-decay" slot weights.
    Differences that are semantics, not speed:
    - labels: ours are the data tokens x_{a+k}; speculators' "ce" takes the argmax of the target
      logits at position a+k-1 (so it runs the frozen target lm_head over every block row as well,
      under no_grad). The synthetic target puts its argmax on the next token (the check counts
      the positions where it does), so the CE values agree row by row.
    - normalisation: ours sum(w_k CE) / sum(w_k) over the counted rows; speculators
      sum(w_k CE) / (number of counted rows + 1e-5). Same rows -> theirs = ours * sum(w) / N.
    - slot weights: both exp(-(k - 1) / gamma) with w_0 = 0 and the same gamma (speculators'
      DFlash recipe default is D-PACE weighting, not used here).
    - anchors: both draw `--num-anchors` per sequence among loss positions, ours with
      a + B <= length, speculators with a < T - B (one candidate fewer); the timed steps draw
      independently (same count), the check feeds both the same anchors. Speculators always
      computes num_anchors blocks (padding ones included); `--num-anchors` is validated to fit,
      so neither side computes padding blocks.
    - ours runs the lm_head (and its backward) on the counted rows only; speculators on every
      block row.
    - speculators packs a batch into one row [1, B*T] with document ids and draws B*num_anchors
      anchors over it; ours pads to [B, T]. With --batch 1 (default) the layouts coincide.
    """

    name, label = "dflash", "DFlash"
    block_size, loss_gamma = DFlashConfig.block_size, DFlashConfig.loss_gamma  # the family's defaults (z-lab recipe)
    lean = 2.0  # target argmax == next token at every position (CE labels agree)
    sample_from_anchor = False  # speculators' layout flag: slot 0 drafts (DSpark) or is the bonus token
    family: ClassVar[DFlashFamily] = DFLASH
    objective_module: ClassVar[ModuleType] = dflash_objective_module
    loss_names = ("CE", "CE")

    def block(self, args: argparse.Namespace) -> int:
        return int(args.block_size if args.block_size is not None else self.block_size)

    def gamma(self, args: argparse.Namespace) -> float:
        return float(args.loss_gamma if args.loss_gamma is not None else self.loss_gamma)

    def candidates(self, args: argparse.Namespace) -> int:
        """Anchor candidates per sequence that both samplers accept: loss positions a < T - B."""
        return max(0, args.seq_len - self.block(args) - int(args.seq_len * args.prompt_frac))

    def validate(self, args: argparse.Namespace) -> list[tuple[str, object, str]]:
        bad: list[tuple[str, object, str]] = []
        bs = self.block(args)
        if bs < 2:
            bad.append(("block-size", bs, f">= 2 ({self.name})"))
        if not self.gamma(args) > 0:
            bad.append(("loss-gamma", self.gamma(args), f"> 0 ({self.name})"))
        if not 1 <= args.context_layers <= NUM_TARGET_LAYERS - 1:
            bad.append(("context-layers", args.context_layers,
                        f"in 1..{NUM_TARGET_LAYERS - 1} (the synthetic target has {NUM_TARGET_LAYERS} layers)"))
        if args.layers < 1:
            bad.append(("layers", args.layers, ">= 1"))
        if args.num_anchors < 1:
            bad.append(("num-anchors", args.num_anchors, ">= 1"))
        elif args.num_anchors > self.candidates(args):
            bad.append(("num-anchors", args.num_anchors,
                        f"<= {self.candidates(args)}, the anchor candidates of a --seq-len {args.seq_len} "
                        f"sequence with --prompt-frac {args.prompt_frac} and block size {bs} ({self.name}; more "
                        "would make speculators compute padding blocks that ours skips)"))
        return bad

    # -- family-specific pieces (DSpark overrides these)

    def our_config(self, args: argparse.Namespace) -> DFlashConfig:
        return DFlashConfig(num_layers=args.layers, block_size=self.block(args),
                            target_layer_ids=tuple(range(args.context_layers)),
                            num_target_features=args.context_layers, loss_gamma=self.gamma(args),
                            num_anchors=args.num_anchors, attn_backend="sdpa")

    def their_model(self, args: argparse.Namespace, ours: DFlashDraft, spec: TargetSpec) -> nn.Module:
        from speculators.models.dflash import DFlashDraftModel, DFlashSpeculatorConfig
        from transformers import Qwen3Config

        cfg = DFlashSpeculatorConfig(**self._their_base_config(args, ours, spec, Qwen3Config))
        return DFlashDraftModel(cfg)

    def _their_base_config(self, args: argparse.Namespace, ours: DFlashDraft, spec: TargetSpec,
                           layer_cls: Any) -> dict[str, Any]:
        assert ours.cfg.target_layer_ids is not None
        bs, sample_from_anchor = self.block(args), self.sample_from_anchor
        return {"transformer_layer_config": layer_config(layer_cls, spec, args.layers),
                "draft_vocab_size": spec.vocab_size, "block_size": bs,
                "aux_hidden_state_layer_ids": list(ours.cfg.target_layer_ids),
                "mask_token_id": ours.cfg.mask_token_id, "sample_from_anchor": sample_from_anchor,
                "speculators_config": speculators_config(self.name, bs if sample_from_anchor else bs - 1)}

    def their_call_kwargs(self, args: argparse.Namespace, ours: DFlashDraft) -> dict[str, Any]:
        from speculators.losses import resolve_loss_config

        return {"loss_config": resolve_loss_config("ce", "eager"), "gamma": self.gamma(args),
                "max_anchors": args.batch * args.num_anchors, "per_position_loss_weight": "fixed-exp-decay"}

    def compare(self, args: argparse.Namespace, out: ObjectiveOutput, ours: DFlashDraft, loss: Tensor,
                metrics: dict[str, Tensor]) -> bool:
        """Print ours against theirs on the same rows; True when they agree within tolerance."""
        n = float(out.metrics["valid_tokens"][0])
        num, den = float(out.numerators[0]), float(out.denominators[0])
        expected, got = num / (n + LOSS_REDUCTION_EPS), float(loss)
        ok = abs(got - expected) <= tolerance(args.dtype) * max(1.0, abs(expected))
        print(f"  counted rows N {n:.0f}, slot-weight sum {den:.2f}")
        print(f"  ours sum(w CE) / sum(w) = {num / den:.4f}; ours sum(w CE) / N = {expected:.4f}; "
              f"speculators = {got:.4f}; diff {got - expected:+.1e}: {'OK' if ok else 'MISMATCH'}")
        return ok

    # -- shared machinery

    def build(self, args: argparse.Namespace) -> Built:
        data = make_data(args, args.context_layers, self.lean)
        ours = self.family.build(self.our_config(args), data.target)
        assert isinstance(ours, DFlashDraft)
        ours.train()
        batch = self.family.collate(data.samples)
        theirs = self.their_model(args, ours, data.target.spec)
        state = dict(ours.state_dict())
        state.update({"embed_tokens.weight": data.target.embed_tokens, "lm_head.weight": data.target.lm_head,
                      "verifier_lm_head.weight": data.target.lm_head,
                      "verifier_norm.weight": data.target.final_norm})
        load_exact(theirs, state, f"speculators {self.name}")
        theirs.train()
        spec_batch = self._speculators_batch(batch, data.pre_norm_last)
        kwargs = self.their_call_kwargs(args, ours)

        def ours_loss() -> Tensor:
            with autocast(args.dtype):
                return self.family.objective(ours, batch).loss()

        def theirs_loss() -> Tensor:
            with autocast(args.dtype):
                loss: Tensor = theirs(**spec_batch, **kwargs)[1]
                return loss

        def check() -> LossCheck:
            return self._check(args, data, ours, batch, theirs, spec_batch, kwargs)

        header = (f"layers={args.layers} block_size={self.block(args)} num_anchors={args.num_anchors} "
                  f"loss_gamma={self.gamma(args)} context_layers={args.context_layers}" + self._header_extra(args))
        return Built(ours, theirs, ours_loss, theirs_loss, check, header, self.loss_names)

    def _header_extra(self, args: argparse.Namespace) -> str:
        return ""

    @staticmethod
    def _speculators_batch(batch: dict[str, Tensor], pre_norm_last: Tensor) -> dict[str, Tensor]:
        """Our padded batch -> speculators' packed row [1, B*T] (no shift: the DFlash family
        aligns inside the model); per-sequence RoPE positions, document ids per sequence."""
        b, t = batch["input_ids"].shape
        valid = batch["loss_mask"].to(torch.bool) & batch["attention_mask"].to(torch.bool)
        return {"input_ids": batch["input_ids"].reshape(1, b * t),
                "hidden_states": batch["aux_hidden"].reshape(1, b * t, -1),
                "verifier_last_hidden_states": pre_norm_last.reshape(1, b * t, -1),
                "loss_mask": valid.long().reshape(1, b * t),
                "document_ids": torch.arange(b).repeat_interleave(t)[None],
                "position_ids": torch.arange(t).repeat(b)[None]}

    def _common_anchors(self, args: argparse.Namespace, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        """Anchors both samplers could draw (loss positions a < T - B, per sequence), sorted:
        (anchors int64 [B, num_anchors], valid bool [B, num_anchors])."""
        g = torch.Generator().manual_seed(args.seed + 1)
        valid = batch["loss_mask"].to(torch.bool) & batch["attention_mask"].to(torch.bool)
        b, t = valid.shape
        anchors = torch.zeros(b, args.num_anchors, dtype=torch.long)
        ok = torch.zeros(b, args.num_anchors, dtype=torch.bool)
        for i in range(b):
            cand = torch.nonzero(valid[i, : t - self.block(args)]).flatten()
            pick = cand[torch.randperm(cand.numel(), generator=g)[: args.num_anchors]].sort().values
            anchors[i, : pick.numel()], ok[i, : pick.numel()] = pick, True
        return anchors, ok

    @contextlib.contextmanager
    def _same_anchors(self, anchors: Tensor, valid: Tensor, seq_len: int) -> Iterator[None]:
        """Both sides' anchor samplers return these anchors (the loss check only): ours per sequence,
        speculators' packed row (offset by sequence * T, valid ones first, padded to B * A)."""
        import speculators.models.dflash.core as their_core

        packed = (anchors + seq_len * torch.arange(anchors.shape[0])[:, None])[valid]
        flat = torch.zeros(anchors.numel(), dtype=torch.long)
        flat_valid = torch.zeros(anchors.numel(), dtype=torch.bool)
        flat[: packed.numel()], flat_valid[: packed.numel()] = packed, True
        with mock.patch.object(self.objective_module, "sample_anchors", lambda *a, **k: (anchors, valid)), \
                mock.patch.object(their_core, "select_anchors", lambda *a, **k: (flat, flat_valid)):
            yield

    def _check(self, args: argparse.Namespace, data: Data, ours: DFlashDraft, batch: dict[str, Tensor],
               theirs: nn.Module, spec_batch: dict[str, Tensor], kwargs: dict[str, Any]) -> LossCheck:
        anchors, valid = self._common_anchors(args, batch)
        with torch.no_grad(), autocast(args.dtype), self._same_anchors(anchors, valid, args.seq_len):
            out = self.family.objective(ours, batch)
            _, loss, metrics = theirs(**spec_batch, **kwargs)
        agree, total = label_agreement(data, batch)
        print(f"loss check (identical weights and anchors, before training; {args.dtype}, tolerance "
              f"{tolerance(args.dtype)} relative):")
        print(f"  target argmax == next token on {agree}/{total} loss positions (speculators' labels = ours"
              f"{'' if agree == total else ': NOT on every position, CE values differ'})")
        ok = self.compare(args, out, ours, loss, metrics) and agree == total
        return LossCheck(ok, float(out.loss()), float(loss))


class DSparkAdapter(DFlashAdapter):
    """DSpark: the DFlash backbone, every slot drafts (slot k predicts x_{a+k+1}), a vanilla Markov
    head (`--markov-rank`) and a confidence head reading [h ; Markov feature].

    Speculators: DSparkDraftModel (sample_from_anchor True), loss '{"ce": 0.1, "tv": 1.8}'
    (eager) + 1.0 * confidence BCE, "fixed-exp-decay" slot weights exp(-k / gamma).
    Differences that are semantics, not speed:
    - loss terms: ours 0.1 CE + 0.9 L1 + 1.0 BCE(conf, 1 - L1 / 2) (DeepSpec); speculators' "tv"
      is TV = L1 / 2, so its weight is 1.8 (= 0.9 L1); its confidence target 1 - TV is ours.
      Its CE label is the target argmax at a+k, ours the data token x_{a+k+1} (equal on this
      synthetic data; the check counts it). Ours takes BCE of the clamped sigmoid, speculators
      BCE with logits (equal away from 0 / 1).
    - normalisation: ours sum(w_k row) / sum(w_k); speculators each term sum(w_k term) /
      (number of counted rows + eps): theirs = ours * sum(w) / N; the check compares the terms.
    - counted slots: ours the contiguous valid prefix of labels a+1..a+k+1; speculators loss_mask at
      the slot's input position a+k. With one contiguous loss span and a < T - B they coincide.
    - anchors: ours among loss positions a with a+1 also valid (a <= T - 2; blocks running past
      the end lose their tail slots); speculators a < T - B. Same count per step; the check feeds
      both the same anchors.
    - ours runs the target head, the Markov bias and the lm_head on the counted rows only;
      speculators on every block row (and evaluates its TV twice: loss and confidence target).
    """

    name, label = "dspark", "DSpark"
    block_size, loss_gamma = DSparkConfig.block_size, DSparkConfig.loss_gamma  # the family's defaults (DeepSpec)
    sample_from_anchor = True
    family = DSPARK
    objective_module: ClassVar[ModuleType] = dspark_objective_module
    loss_names = ("0.1CE+0.9L1+conf", "0.1CE+1.8TV+conf")

    def validate(self, args: argparse.Namespace) -> list[tuple[str, object, str]]:
        bad = super().validate(args)
        if args.markov_rank < 1:
            bad.append(("markov-rank", args.markov_rank, ">= 1 (dspark: the confidence head reads the Markov feature)"))
        return bad

    def our_config(self, args: argparse.Namespace) -> DSparkConfig:
        return DSparkConfig(num_layers=args.layers, block_size=self.block(args),
                            target_layer_ids=tuple(range(args.context_layers)),
                            num_target_features=args.context_layers, loss_gamma=self.gamma(args),
                            num_anchors=args.num_anchors, attn_backend="sdpa", markov_rank=args.markov_rank,
                            markov_head_type="vanilla")

    def their_model(self, args: argparse.Namespace, ours: DFlashDraft, spec: TargetSpec) -> nn.Module:
        from speculators.models.dspark import DSparkDraftModel, DSparkSpeculatorConfig
        from transformers import Qwen3Config

        cfg = DSparkSpeculatorConfig(**self._their_base_config(args, ours, spec, Qwen3Config),
                                     markov_rank=args.markov_rank, markov_head_type="vanilla",
                                     enable_confidence_head=True, confidence_head_with_markov=True)
        return DSparkDraftModel(cfg)

    def their_call_kwargs(self, args: argparse.Namespace, ours: DFlashDraft) -> dict[str, Any]:
        from speculators.losses import resolve_loss_config

        cfg = ours.cfg
        assert isinstance(cfg, DSparkConfig)
        spec = json.dumps({"ce": cfg.ce_weight, "tv": 2.0 * cfg.l1_weight})
        return {"loss_config": resolve_loss_config(spec, "eager"),
                "tv_loss_fn": resolve_loss_config("tv", "eager")["tv"][0], "gamma": self.gamma(args),
                "max_anchors": args.batch * args.num_anchors, "confidence_head_alpha": cfg.conf_weight,
                "per_position_loss_weight": "fixed-exp-decay"}

    def compare(self, args: argparse.Namespace, out: ObjectiveOutput, ours: DFlashDraft, loss: Tensor,
                metrics: dict[str, Tensor]) -> bool:
        cfg = ours.cfg
        assert isinstance(cfg, DSparkConfig)
        n = float(out.metrics["valid_tokens"][0])
        den = float(out.denominators[0])
        tol = tolerance(args.dtype)
        print(f"  counted rows N {n:.0f}, slot-weight sum {den:.2f}; per term sum(w term) / N:")
        print(f"  {'term':<22}{'ours':>10}{'speculators':>13}{'diff':>10}")
        rows = (("CE", float(out.metrics["ce"][0]) / n, float(metrics["ce_loss_sum"])),
                ("L1 / 2 (= TV)", float(out.metrics["l1"][0]) / (2 * n), float(metrics["tv_loss_sum"])),
                ("confidence BCE", float(out.metrics["conf_bce"][0]) / n, float(metrics["confidence_loss_sum"])),
                ("total", float(out.numerators[0]) / n, float(loss)))
        ok = True
        for term, a, b in rows:
            ok &= abs(b - a) <= tol * max(1.0, abs(a))
            print(f"  {term:<22}{a:>10.4f}{b:>13.4f}{b - a:>+10.1e}")
        print(f"  ours loss sum(w row) / sum(w) = {float(out.loss()):.4f}; "
              f"{'OK' if ok else 'MISMATCH'} (total = {cfg.ce_weight} CE + {cfg.l1_weight} L1 + "
              f"{cfg.conf_weight} BCE)")
        return ok

    def _header_extra(self, args: argparse.Namespace) -> str:
        return f" markov_rank={args.markov_rank} (vanilla) confidence_head=[h;e]"


# ----------------------------------------------------------------------------- P-EAGLE

class PEagleAdapter(Adapter):
    """P-EAGLE: EAGLE-3's architecture (fused 2H layer 0, `--peagle-layers` - 1 plain Llama layers
    after it) plus a learnable `mask_hidden` [1, 3H]; all `--num-depths` depths in one flattened
    forward over COD-sampled elements (drafters/peagle/cod.py), one count-normalised loss term.

    Both drafts have the same sizes, the same draft vocab (d2t/t2d from the same token counts),
    the same frozen target embedding and identical weights (mask_hidden included, [1, 3H] ->
    speculators' [1, 1, 3H]). Speculators: PEagleDraftModel (Eagle3DraftModel's layers), loss
    "kl_div" (eager), its COD sampler (`generate_cod_sample_indices`) with the same K, r, r_min.
    Element conventions: ours (a, d) = anchor a, depth d; input (x_{a+1}, f_a) at d = 0,
    (MASK, mask_hidden) at d >= 1; RoPE position a + d; target at position a + 1 + d (predicts
    x_{a+2+d}). Speculators' (anchor_pos, depth) with reference position r = anchor_pos + depth
    indexes its pre-shifted row (Eagle3Adapter._speculators_batch: input_ids[r] = x_{r+1},
    hidden_states[r] = f_r, verifier_last_hidden_states[r] = y_{r+1}, loss_mask[r] = our mask at
    r + 1) for the depth-0 inputs, the RoPE position and the target. So anchor_pos = a, depth = d
    denote the same element (packed: anchor_pos = row * T + a; RoPE positions then carry the
    row offset, which attention within a document does not see) and the mask rules are the same
    (depth-0 keys at or before the anchor, plus the element's own chain, same document).
    Differences that are semantics, not speed:
    - speculators trains KL(p || q) = CE(p, q) - H(p); we train the soft CE(p, q). Both divide by
      the counted elements N (speculators by N + 1e-5): ours = speculators + mean target entropy
      over the counted elements (per depth too); the check prints the residual.
    - loss mask: ours counts an element iff its target is trainable and its argmax is in the draft
      vocab; speculators takes the loss mask as data and is fed that same position mask. COD
      pools: ours chains continue through trainable targets whose argmax is outside the draft vocab
      (no loss there), speculators' only through its loss mask; its budget is
      int((n - d) * max(r^d, r_min)) with n its loss positions, ours floor(... + 1e-9) with n the
      trainable ones. The timed steps draw independently on each side (the check prints one draw's
      element counts per side); the loss check feeds speculators our elements (its sampler patched).
    - speculators' P-EAGLE trains the embedding by default (`embed_requires_grad` True); ours
      keeps the target's embedding frozen, so speculators is built with embed_requires_grad False
      (otherwise its AdamW updates a [V, H] table we do not train).
    - speculators freezes its lm_head by default; both sides TRAIN it here (as ours does) unless
      `--frozen-lm-head` freezes it on both sides.
    - speculators packs a batch into one row [1, B*T] (depth-0 elements over all B*T positions);
      ours pads to [B, N] per row. With --batch 1 (default) the work is identical.
    """

    name, label = "peagle", "P-EAGLE"
    # as eagle3. At the default shapes every loss target's argmax is in the draft vocab (mean
    # target entropy ~0.37), so both COD samplers draw from the same pools and the timed steps
    # compute the same number of elements; at --quick shapes (draft vocab 512 of 2048) ~40% are
    # not, speculators' pools shrink (fewer elements per step: a smoke-run ratio only)
    lean = 0.3

    def validate(self, args: argparse.Namespace) -> list[tuple[str, object, str]]:
        bad: list[tuple[str, object, str]] = []
        if not 0 < args.draft_vocab <= args.vocab:
            bad.append(("draft-vocab", args.draft_vocab, f"in 1..--vocab={args.vocab}"))
        if args.num_depths < 1:
            bad.append(("num-depths", args.num_depths, ">= 1"))
        if args.peagle_layers < 1:
            bad.append(("peagle-layers", args.peagle_layers, ">= 1"))
        if not 0 < args.cod_ratio <= 1:
            bad.append(("cod-ratio", args.cod_ratio, "in (0, 1]"))
        if not 0 <= args.cod_ratio_min <= 1:
            bad.append(("cod-ratio-min", args.cod_ratio_min, "in [0, 1]"))
        if args.seq_len < 2:
            bad.append(("seq-len", args.seq_len, ">= 2 (peagle)"))
        return bad

    def build(self, args: argparse.Namespace) -> Built:
        from speculators.losses import resolve_loss_config

        data = make_data(args, 3, self.lean)
        cfg = self.our_config(args)
        ours = PEAGLE.build(cfg, data.target, StoreStats(token_counts=token_counts_from_samples(data.samples,
                                                                                               args.vocab)))
        assert isinstance(ours, PEagleModel)
        if args.frozen_lm_head:
            ours.lm_head.weight.requires_grad_(False)
        ours.train()
        batch = PEAGLE.collate(data.samples)
        theirs = self._speculators(args, ours, data)
        with torch.no_grad():
            position_mask = prepare_targets(ours, batch).position_mask
        spec_batch = Eagle3Adapter._speculators_batch(batch, data.pre_norm_last, position_mask)
        kwargs: dict[str, Any] = {"loss_config": resolve_loss_config("kl_div", "eager"),
                                  "num_depths": args.num_depths, "down_sample_ratio": args.cod_ratio,
                                  "down_sample_ratio_min": args.cod_ratio_min}

        def ours_loss() -> Tensor:
            with autocast(args.dtype):
                return PEAGLE.objective(ours, batch).loss()

        def theirs_loss() -> Tensor:
            with autocast(args.dtype):
                loss: Tensor = theirs(**spec_batch, **kwargs)[1]
                return loss

        def check() -> LossCheck:
            return self._check(args, ours, batch, theirs, spec_batch, kwargs)

        header = (f"draft_vocab={args.draft_vocab} layers={args.peagle_layers} num_depths={args.num_depths} "
                  f"cod_ratio={args.cod_ratio} cod_ratio_min={args.cod_ratio_min} "
                  f"lm_head={'frozen' if args.frozen_lm_head else 'trained'}")
        return Built(ours, theirs, ours_loss, theirs_loss, check, header, ("soft CE", "KL"))

    def our_config(self, args: argparse.Namespace) -> PEagleConfig:
        return PEagleConfig(draft_vocab_size=args.draft_vocab, num_layers=args.peagle_layers,
                            num_depths=args.num_depths, cod_ratio=args.cod_ratio, cod_ratio_min=args.cod_ratio_min,
                            attn_backend="sdpa", lm_head_init="target")

    @staticmethod
    def _speculators(args: argparse.Namespace, ours: PEagleModel, data: Data) -> nn.Module:
        """speculators' PEagleDraftModel with our sizes and a copy of our weights."""
        from speculators.config import SpeculatorsConfig
        from speculators.models.peagle import PEagleDraftModel, PEagleSpeculatorConfig
        from speculators.proposals.greedy import GreedyTokenProposalConfig
        from transformers import LlamaConfig

        assert ours.cfg.aux_layer_ids is not None
        spec_cfg = SpeculatorsConfig(
            algorithm="peagle", default_proposal_method="greedy",
            proposal_methods=[GreedyTokenProposalConfig(speculative_tokens=args.num_depths)],
            verifier=verifier_config("LlamaForCausalLM"))
        cfg = PEagleSpeculatorConfig(
            transformer_layer_config=layer_config(LlamaConfig, data.target.spec, args.peagle_layers),
            draft_vocab_size=args.draft_vocab, eagle_aux_hidden_state_layer_ids=list(ours.cfg.aux_layer_ids),
            mask_token_id=ours.mask_token_id, embed_requires_grad=False, speculators_config=spec_cfg)
        model = PEagleDraftModel(cfg)
        model.load_vocab_mappings(ours.t2d.clone(), ours.d2t.clone())
        state = {("layers.0." + k[len("midlayer."):] if k.startswith("midlayer.") else k): v
                 for k, v in ours.state_dict().items() if k not in ("d2t", "t2d")}
        state["mask_hidden"] = state["mask_hidden"].reshape(1, 1, -1)
        state["verifier_lm_head.weight"] = data.target.lm_head[ours.t2d]
        state["verifier_norm.weight"] = data.target.final_norm
        load_exact(model, state, "speculators peagle", may_miss=("d2t", "t2d"))  # set by load_vocab_mappings
        model.lm_head.weight.requires_grad_(not args.frozen_lm_head)
        return model.train()

    @staticmethod
    def _their_elements(layout: CODLayout) -> tuple[Tensor, Tensor]:
        """Our layout -> speculators' (anchor_pos, depth) over its packed row [1, B*T]: the depth-0
        elements are every packed position (as its sampler), then per depth each row's kept
        anchors (offset by row * T). anchor_pos + depth is the reference position (class docstring)."""
        b, t = layout.document.shape
        packed = layout.anchor + t * torch.arange(b, device=layout.anchor.device)[:, None]
        anchors, depths = [torch.arange(b * t)], [torch.zeros(b * t, dtype=torch.long)]
        for d in range(1, int(layout.counts.shape[1])):
            sel = layout.exists & (layout.depth == d)
            anchors.append(packed[sel].cpu())
            depths.append(torch.full((int(sel.sum()),), d, dtype=torch.long))
        return torch.cat(anchors), torch.cat(depths)

    @staticmethod
    def _draw_counts(args: argparse.Namespace, batch: dict[str, Tensor], spec_batch: dict[str, Tensor]) -> str:
        """One independent COD draw per side (the timed steps' samplers), elements per depth."""
        from speculators.models.peagle.data import generate_cod_sample_indices

        attention = batch["attention_mask"].to(torch.bool)
        trainable = batch["loss_mask"].to(torch.bool) & attention
        g = torch.Generator().manual_seed(args.seed + 2)
        layout = cod_sample(trainable, document_ids(attention), args.num_depths, args.cod_ratio,
                            args.cod_ratio_min, g)
        ours = [int(x) for x in layout.counts.sum(0)]
        with torch.random.fork_rng():
            torch.manual_seed(args.seed + 2)
            _, depth = generate_cod_sample_indices(
                seq_length=int(spec_batch["input_ids"].shape[1]), loss_mask=spec_batch["loss_mask"],
                num_depths=args.num_depths, down_sample_ratio=args.cod_ratio,
                down_sample_ratio_min=args.cod_ratio_min)
        theirs = torch.bincount(depth, minlength=args.num_depths).tolist()
        return (f"ours {sum(ours)} = {'+'.join(map(str, ours))}, speculators {sum(theirs)} = "
                f"{'+'.join(map(str, theirs))}")

    def _check(self, args: argparse.Namespace, ours: PEagleModel, batch: dict[str, Tensor], theirs: nn.Module,
               spec_batch: dict[str, Tensor], kwargs: dict[str, Any]) -> LossCheck:
        """Same weights, same elements: per depth ours CE - H (mean target entropy) == speculators' KL."""
        import speculators.models.peagle.core as their_core
        from speculators.losses.eager import kl_div_loss

        cfg = ours.cfg
        attention = batch["attention_mask"].to(torch.bool)
        trainable = batch["loss_mask"].to(torch.bool) & attention
        layout = cod_sample(trainable, document_ids(attention), cfg.num_depths, cfg.cod_ratio, cfg.cod_ratio_min,
                            torch.Generator().manual_seed(args.seed + 1))
        anchor_pos, depth = self._their_elements(layout)
        seen: dict[str, Tensor] = {}
        chunks: dict[str, list[Tensor]] = {"probs": [], "logits": []}

        def ours_ce(draft_logits: Tensor, probs: Tensor) -> tuple[Tensor, Tensor]:  # one chunk of rows
            chunks["logits"].append(draft_logits.detach())
            chunks["probs"].append(probs.detach())
            return soft_ce_grad_rows(draft_logits, probs)

        def their_kl(logits: Tensor, targets: Tensor) -> Tensor:
            out: Tensor = kl_div_loss(logits, targets)
            seen["kl"] = out.detach()
            return out

        check_kwargs = {**kwargs, "loss_config": {"kl_div": (their_kl, 1.0)}}
        with torch.no_grad(), autocast(args.dtype), \
                mock.patch.object(peagle_objective_module, "cod_sample", lambda *a, **k: layout), \
                mock.patch.object(fused_head_module, "soft_ce_grad_rows", ours_ce), \
                mock.patch.object(their_core, "generate_cod_sample_indices", lambda *a, **k: (anchor_pos, depth)):
            out = PEAGLE.objective(ours, batch)
            _, spec_loss, metrics = theirs(**spec_batch, **check_kwargs)
            targets = prepare_targets(ours, batch)
        # our counted elements, in the objective's order (drafters/peagle/objective.py)
        target_pos = layout.target_position()
        beyond = layout.anchor + 1 + layout.depth >= layout.seq_len
        scored = layout.exists & ~beyond & torch.gather(targets.position_mask, 1, target_pos)
        ours_depth = layout.depth[scored.nonzero(as_tuple=True)]
        probs = torch.cat(chunks["probs"]).float()  # [M, Vd]
        logits = torch.cat(chunks["logits"]).float()
        ce = -(probs * torch.log_softmax(logits, -1)).sum(-1)
        ent = -(probs * probs.clamp_min(1e-30).log()).sum(-1)
        their_mask = spec_batch["loss_mask"][0, anchor_pos + depth].to(torch.bool)
        kl = seen["kl"].reshape(-1).float()
        tol = tolerance(args.dtype)
        print(f"loss check (identical weights and COD elements, before training; {args.dtype}, tolerance {tol} "
              "relative):")
        print(f"  elements: ours {int(layout.exists.sum())}, speculators {int(anchor_pos.numel())}; counted "
              f"{int(ours_depth.numel())} / {int(their_mask.sum())}; one independent draw per side (timed steps): "
              f"{self._draw_counts(args, batch, spec_batch)}")
        print(f"  {'depth':>5} {'rows':>11} {'ours CE':>10} {'target H':>10} {'ours CE-H':>10} {'spec KL':>10} "
              f"{'diff':>9} {'acc ours/spec':>14}")
        ok = ce.numel() == ours_depth.numel() and kl.numel() == depth.numel()
        for d in range(cfg.num_depths):
            mine, spec_rows = ours_depth == d, their_mask & (depth == d)
            n_ours, n_spec = int(mine.sum()), int(spec_rows.sum())
            ok &= n_ours == n_spec
            if n_ours == 0 and n_spec == 0:
                continue
            ce_d, h_d = float(ce[mine].mean()), float(ent[mine].mean())
            kl_d = float(kl[spec_rows].mean())
            diff = ce_d - h_d - kl_d
            ok &= abs(diff) <= tol * max(1.0, abs(ce_d))
            acc_ours = float(out.metrics[f"acc_pos{d}"][0]) / max(float(out.metrics[f"acc_pos{d}"][1]), 1.0)
            acc_spec = float(metrics[f"position_{d}_acc_sum"]) / max(float(metrics[f"position_{d}_acc_total"]), 1.0)
            print(f"  {d:>5} {f'{n_ours}/{n_spec}':>11} {ce_d:>10.4f} {h_d:>10.4f} {ce_d - h_d:>10.4f} {kl_d:>10.4f} "
                  f"{diff:>+9.1e} {f'{acc_ours:.3f}/{acc_spec:.3f}':>14}")
        total, n = float(out.loss()), float(ours_depth.numel())
        entropy = float(ent.mean()) if ent.numel() else 0.0
        spec_mean = float(spec_loss) * (n + LOSS_REDUCTION_EPS) / max(n, 1.0)  # theirs divides by N + 1e-5
        residual = total - entropy - spec_mean
        ok &= abs(residual) <= tol * max(1.0, abs(total))
        print(f"  total (one term / N): ours {total:.4f} (soft CE) = speculators {float(spec_loss):.4f} (KL) + "
              f"target entropy {entropy:.4f}; residual {residual:+.1e}: {'OK' if ok else 'MISMATCH'}")
        return LossCheck(ok, total, float(spec_loss))


# ----------------------------------------------------------------------------- the table

ADAPTERS: dict[str, Adapter] = {a.name: a for a in (Eagle3Adapter(), DFlashAdapter(), DSparkAdapter(),
                                                     PEagleAdapter())}
