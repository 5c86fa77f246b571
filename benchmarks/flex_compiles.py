"""How many graphs compiled flex attention needs for one EAGLE-3 TTT step and for DFlash steps.

`flex_compile_counts(device)` runs, with the flex backend and flex compiled on `device` (CUDA's
code path; on CPU through `compiled_flex_on`), tiny random drafts:

- one EAGLE-3 training-time-test unroll: `ttt_steps` steps, each with its own key length
  ((j + 1) * T), query length and row offset (the objective's `row_start`);
- two DFlash forwards that differ in context length, block count and block size (a training
  step's B rows, then a drafting step's K + 1 < B rows);

and counts the graphs dynamo compiles for each (`torch._dynamo.utils.counters["stats"]
["unique_graphs"]`, after `torch._dynamo.reset()`: every earlier compile of the process is dropped).
Shape-generic masks give 1 and 1; a mask function or BlockMask that carries Python ints gives
one more graph per int that changes, and past `torch._dynamo.config.recompile_limit` flex runs
uncompiled. On CPU run it forward only (flex has no CPU backward in torch 2.13).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch._dynamo.utils import counters

from drafters.common.attention import compiled_flex_on
from drafters.common.target import TargetHead, TargetSpec
from drafters.common.vocab import DraftVocab
from drafters.dflash.config import DFlashConfig
from drafters.dflash.model import DFlashDraft
from drafters.eagle3.config import Eagle3Config
from drafters.eagle3.model import Eagle3Model

TTT_ROW_STARTS = (0, 0, 3, 5, 8, 13, 21)  # non-decreasing; every step a new query length and offset
DFLASH_STEPS = ((110, 34, 4), (160, 50, 3))  # (context length n, blocks nb, rows per block B)


@dataclass(frozen=True)
class FlexCompileCounts:
    eagle3_ttt: int  # graphs compiled over one TTT unroll of `ttt_steps` steps
    dflash: int  # graphs compiled over the DFlash steps of DFLASH_STEPS
    ttt_steps: int
    recompile_limit: int  # torch._dynamo.config.recompile_limit: past it flex runs uncompiled

    @property
    def ok(self) -> bool:
        """One graph per mask function, whatever the number of steps and shapes."""
        return self.eagle3_ttt == 1 and self.dflash == 1


def _spec() -> TargetSpec:
    return TargetSpec(vocab_size=64, hidden_size=64, num_hidden_layers=6, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, intermediate_size=128, rope_theta=10000.0,
                      rms_norm_eps=1e-6, max_position_embeddings=1024, model_type="qwen3",
                      tie_word_embeddings=False)


def _head(spec: TargetSpec, g: torch.Generator) -> TargetHead:
    v, h = spec.vocab_size, spec.hidden_size
    return TargetHead(spec, torch.randn(v, h, generator=g), torch.randn(v, h, generator=g), torch.ones(h))


def _graphs() -> int:
    return int(counters["stats"]["unique_graphs"])


def flex_compile_counts(device: torch.device, dtype: torch.dtype = torch.float32, backward: bool = False,
                        seq_len: int = 160, seed: int = 0) -> FlexCompileCounts:
    """Graphs compiled for one EAGLE-3 TTT unroll and for the DFlash steps (module docstring) on
    `device` in `dtype`; `backward` also differentiates a loss through every step (CUDA only)."""
    if backward and device.type != "cuda":
        raise ValueError(f"backward: True on device type {device.type!r}, expected cuda (flex attention has no "
                         "backward on CPU in torch 2.13); run forward only elsewhere")
    if TTT_ROW_STARTS[-1] >= seq_len:
        raise ValueError(f"seq_len: got {seq_len}, expected > {TTT_ROW_STARTS[-1]} (the last TTT row offset)")
    g = torch.Generator().manual_seed(seed)
    spec = _spec()
    head = _head(spec, g)
    torch.manual_seed(seed)
    steps = len(TTT_ROW_STARTS)
    eagle = Eagle3Model(Eagle3Config(aux_layer_ids=(1, 3, 4), ttt_steps=steps, attn_backend="flex"), head,
                        DraftVocab.identity(spec.vocab_size)).to(device, dtype)
    dflash = DFlashDraft(DFlashConfig(num_layers=1, block_size=4, target_layer_ids=(1, 3), num_target_features=2,
                                      mask_token_id=0, attn_backend="flex"), head).to(device, dtype)
    b, h = 2, spec.hidden_size
    valid = torch.ones(b, seq_len, dtype=torch.bool)
    valid[1, seq_len - 7:] = False  # a right-padded row
    ids = torch.randint(0, spec.vocab_size, (steps, b, seq_len), generator=g)
    aux = torch.randn(b, seq_len, 3 * h, generator=g)
    torch._dynamo.reset()
    with compiled_flex_on(device.type):
        start = _graphs()
        with torch.set_grad_enabled(backward):
            out = eagle.unroll(ids.to(device), aux.to(device, dtype), valid.to(device), row_start=list(TTT_ROW_STARTS))
            if backward:
                torch.stack([x.float().sum() for x in out]).sum().backward()
        ttt = _graphs() - start
        start = _graphs()
        for n, nb, rows in DFLASH_STEPS:
            features = torch.randn(b, n, 2 * h, generator=g).to(device, dtype)
            anchors = torch.sort(torch.randperm(n - rows, generator=g)[: b * nb].view(b, nb), dim=1).values
            anchor_valid = torch.ones(b, nb, dtype=torch.bool)
            anchor_valid[1, -1] = False  # a padding block
            block_ids = torch.randint(0, spec.vocab_size, (b, nb, rows), generator=g)
            with torch.set_grad_enabled(backward):
                x = dflash(features, block_ids.to(device), anchors.to(device), anchor_valid.to(device))
                if backward:
                    x.float().sum().backward()
        blocks = _graphs() - start
    return FlexCompileCounts(ttt, blocks, steps, int(torch._dynamo.config.recompile_limit))
