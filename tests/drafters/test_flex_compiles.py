"""Compiled flex attention: one graph per mask function over a whole EAGLE-3 TTT step and over
DFlash steps of different shapes (CUDA's code path, compiled on CPU: forward only), with outputs
equal to SDPA over the dense masks; mask functions capture tensors, never Python ints."""

from __future__ import annotations

import pytest
import torch

from benchmarks import attention_checks as checks
from benchmarks.flex_compiles import DFLASH_STEPS, flex_compile_counts
from drafters.common.blocks import block_mask_mod
from drafters.common.masks import dense_attention_mask, ttt_mask_mod
from drafters.peagle.cod import chain_layout, cod_mask_mod


@pytest.mark.slow  # inductor compiles two flex graphs to C++: about 40 s on 2 cores, seconds from its cache
def test_one_compiled_graph_per_mask_function_for_every_ttt_step_and_dflash_shape() -> None:
    with checks.compare_flex_to_dense() as flex:
        counts = flex_compile_counts(torch.device("cpu"))
    assert counts.ttt_steps == 7 and counts.recompile_limit >= 2
    # 7 TTT steps, each its own key length, query length and row offset: one graph; two DFlash
    # steps with other context lengths, block counts and block sizes: one graph (its own mask function)
    assert (counts.eagle3_ttt, counts.dflash) == (1, 1), counts
    assert counts.ok
    # every compiled call agrees with float32 SDPA over the dense mask of the same mask function
    assert flex.calls == counts.ttt_steps + len(DFLASH_STEPS) and flex.failures == 0, flex
    assert flex.max_diff < 1e-5 and flex.dtypes == {"float32"}


def _captured(mask_mod: object) -> list[object]:
    closure = getattr(mask_mod, "__closure__", None) or ()
    return [cell.cell_contents for cell in closure]


def test_mask_functions_capture_tensors_not_python_ints() -> None:
    valid = torch.ones(2, 6, dtype=torch.bool)
    anchors, anchor_valid = torch.tensor([[1, 3]]), torch.tensor([[True, True]])
    layout = chain_layout(4, 3)
    for mask_mod in (ttt_mask_mod(valid, 2), block_mask_mod(anchors, anchor_valid, 6, 3),
                     cod_mask_mod(layout), dense_attention_mask(torch.ones(3, 3).tril()).mask_mod):
        captured = _captured(mask_mod)
        assert captured and all(isinstance(c, torch.Tensor) or c is None for c in captured), \
            [type(c).__name__ for c in captured]
