"""P-EAGLE draft model: EAGLE-3's plus `mask_hidden` [1, k*H_t] (at the pre-fc width, standing in for the
target features at mask slots), run over the COD element layout in one forward -> [B, N, H]. With
`num_segments` > 1 the deeper elements run per anchor range under checkpoint: same outputs, less memory."""

from __future__ import annotations

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from drafters.common.layers import KV
from drafters.common.masks import shift_left
from drafters.common.target import TargetHead
from drafters.common.vocab import DraftVocab
from drafters.eagle3.model import Eagle3Backbone
from drafters.peagle.cod import CODLayout, cod_structured_mask, segment_indices
from drafters.peagle.config import PEagleConfig


def _gather(x: Tensor, index: Tensor) -> Tensor:
    """x [B, N, *] rows at index [B, M] (-1 -> row 0, a padding row the mask isolates) -> [B, M, *]."""
    idx = index.clamp(min=0)
    return torch.gather(x, 1, idx.view(*idx.shape, *([1] * (x.dim() - 2))).expand(*idx.shape, *x.shape[2:]))


class PEagleModel(Eagle3Backbone[PEagleConfig]):
    def __init__(self, cfg: PEagleConfig, target: TargetHead, vocab: DraftVocab):
        cfg = cfg.resolve(target.spec)
        super().__init__(cfg, target, vocab)
        assert cfg.aux_layer_ids is not None
        self.mask_hidden = nn.Parameter(torch.randn(1, len(cfg.aux_layer_ids) * target.spec.hidden_size))

    @property
    def mask_token_id(self) -> int:
        assert self.cfg.mask_token_id is not None
        return self.cfg.mask_token_id

    def element_inputs(self, input_ids: Tensor, aux_hidden: Tensor, layout: CODLayout) -> tuple[Tensor, Tensor]:
        """input_ids [B, T] (x_p), aux_hidden [B, T, k*H_t] (f_p) -> (embeds [B, N, H], h [B, N, H])."""
        next_ids = shift_left(input_ids.long(), 1)  # row a holds x_{a+1}
        depth0 = layout.depth == 0  # [B, N]
        ids = torch.where(depth0, torch.gather(next_ids, 1, layout.anchor), torch.full_like(layout.anchor,
                                                                                            self.mask_token_id))
        # fc per position and once for mask_hidden, then gathered (fc is row-wise: the same rows)
        h_pos = self.fc(aux_hidden.to(self.fc.weight.dtype))  # [B, T, H]
        h_mask = self.fc(self.mask_hidden.to(self.fc.weight.dtype))  # [1, H]
        h = torch.where(depth0[..., None], _gather(h_pos, layout.anchor), h_mask.expand(*layout.anchor.shape, -1))
        return self.embed_tokens(ids), h

    def _run(self, embeds: Tensor, h: Tensor, pos: Tensor, layout: CODLayout, q_index: Tensor | None,
             kv_index: Tensor | None, kv_before: list[KV] | None) -> tuple[Tensor, list[KV]]:
        mask = cod_structured_mask(layout, q_index, kv_index)
        return self._layers(embeds, h, pos, mask, kv_before)

    def forward(self, input_ids: Tensor, aux_hidden: Tensor, layout: CODLayout,
                position_ids: Tensor | None = None) -> Tensor:
        """All elements of `layout` in one flattened forward (or partitioned, `cfg.num_segments`):
        input_ids [B, T], aux_hidden [B, T, k*H_t], position_ids [B, T] -> post-norm hidden [B, N, H]."""
        embeds, h = self.element_inputs(input_ids, aux_hidden, layout)
        pos = layout.position_ids(position_ids)
        segments = segment_indices(layout, self.cfg.num_segments) if self.cfg.num_segments > 1 else None
        if segments is None:
            out, _ = self._run(embeds, h, pos, layout, None, None, None)
            return self.norm(out)
        t = layout.seq_len  # the depth-0 elements are 0..T-1 (depth-major layout)
        base = torch.arange(t, device=embeds.device).expand(embeds.shape[0], t)
        out0, kv0 = self._run(embeds[:, :t], h[:, :t], pos[:, :t], layout, base, base, None)
        result = torch.zeros_like(embeds)
        result[:, :t] = out0
        for index in segments:
            kv_index = torch.cat([base, index], dim=1)

            def segment(e: Tensor, hh: Tensor, p: Tensor, *kv: Tensor, index: Tensor = index,
                        kv_index: Tensor = kv_index) -> Tensor:
                pairs = [(kv[2 * i], kv[2 * i + 1]) for i in range(len(kv) // 2)]
                return self._run(e, hh, p, layout, index, kv_index, pairs)[0]

            flat = [x for pair in kv0 for x in pair]
            seg_out = checkpoint(segment, _gather(embeds, index), _gather(h, index), _gather(pos[..., None], index)[..., 0],
                                 *flat, use_reentrant=False)
            real = index >= 0
            rows = real.nonzero(as_tuple=True)
            result = result.index_put((rows[0], index[rows]), seg_out[rows])
        return self.norm(result)
