"""P-EAGLE adapter of scripts/bench_train_step.py: ours and speculators' at equal shapes
(benchmarks/train_step_adapters.py: what an adapter is)."""

from __future__ import annotations

import argparse
from typing import Any
from unittest import mock

import torch
from torch import Tensor, nn

import drafters.common.fused_head as fused_head_module
import drafters.peagle.objective as peagle_objective_module
from benchmarks.train_step_common import (
    LOSS_REDUCTION_EPS,
    Adapter,
    Built,
    Data,
    LossCheck,
    autocast,
    layer_config,
    load_exact,
    make_data,
    tolerance,
    verifier_config,
)
from benchmarks.train_step_eagle3 import Eagle3Adapter, build_ours
from drafters.common.chunked_head import soft_ce_grad_rows
from drafters.eagle3.objective import prepare_targets
from drafters.peagle import FAMILY as PEAGLE
from drafters.peagle import PEagleConfig, PEagleModel
from drafters.peagle.cod import CODLayout, cod_sample, document_ids


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
        ours, batch, position_mask = build_ours(PEAGLE, self.our_config(args), args, data)
        assert isinstance(ours, PEagleModel)
        theirs = self._speculators(args, ours, data)
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
