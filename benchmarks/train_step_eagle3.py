"""EAGLE-3 adapter of scripts/bench_train_step.py: our EAGLE-3 and speculators' at equal shapes
(benchmarks/train_step_adapters.py: what an adapter is)."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from benchmarks.train_step_common import (
    Adapter,
    Built,
    Data,
    LossCheck,
    autocast,
    layer_config,
    load_exact,
    make_data,
    speculators_config,
    tolerance,
)
from drafters.common.contract import StoreStats
from drafters.common.vocab import token_counts_from_samples
from drafters.eagle3 import FAMILY as EAGLE3
from drafters.eagle3 import Eagle3Config, Eagle3Model
from drafters.eagle3.objective import prepare_targets


def build_ours(family: Any, cfg: Any, args: argparse.Namespace, data: Data) -> tuple[Any, dict[str, Tensor], Tensor]:
    """Our EAGLE-3-style draft (EAGLE-3, P-EAGLE) on the synthetic store's token counts, in train mode
    (its lm_head frozen with --frozen-lm-head); the batch; the position mask speculators' batch takes
    (`prepare_targets`)."""
    ours = family.build(cfg, data.target, StoreStats(token_counts=token_counts_from_samples(data.samples, args.vocab)))
    if args.frozen_lm_head:
        ours.lm_head.weight.requires_grad_(False)
    ours.train()
    batch = family.collate(data.samples)
    with torch.no_grad():
        position_mask = prepare_targets(ours, batch).position_mask
    return ours, batch, position_mask

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
        ours, batch, position_mask = build_ours(EAGLE3, self.our_config(args), args, data)
        assert isinstance(ours, Eagle3Model)
        theirs = self._speculators(args, ours, data)
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
