"""DFlash and DSpark adapters of scripts/bench_train_step.py: ours and speculators' at equal shapes
(benchmarks/train_step_adapters.py: what an adapter is)."""

from __future__ import annotations

import argparse
import contextlib
import json
from collections.abc import Iterator
from types import ModuleType
from typing import Any, ClassVar
from unittest import mock

import torch
from torch import Tensor, nn

import drafters.dflash.objective as dflash_objective_module
import drafters.dspark.objective as dspark_objective_module
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
)
from drafters.common.losses import ObjectiveOutput
from drafters.common.target import TargetSpec
from drafters.dflash import FAMILY as DFLASH
from drafters.dflash import DFlashConfig, DFlashDraft
from drafters.dflash.family import DFlashFamily
from drafters.dspark import FAMILY as DSPARK
from drafters.dspark import DSparkConfig


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
