"""Serving a sub-layout from a store captured with more layers (one store for several drafter families).

A store's ``aux_hidden [T, k*H]`` holds ``store.layer_ids``' hidden states concatenated in that order;
``select_layout(store, wanted)`` gives a consumer exactly ``wanted.layer_ids``' columns in its own
order (``sel.aux(aux_hidden)``, ``sel.apply(sample)``). Conventions must be equal, a wanted
``last_hidden`` (other than "none") and ``tag`` (non-empty) must be the store's, and every wanted id
must be stored (else ``LayoutMismatchError`` naming the missing ids). The identity selection returns
the sample itself, a contiguous run is a view, anything else a gather; no wanted ids drops ``aux_hidden``."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from feature_store.errors import LayoutMismatchError
from feature_store.schema import Layout

AUX_FIELD = "aux_hidden"


@dataclass(frozen=True)
class LayoutSelection:
    """Which of the store's layers a consumer reads: ``positions[j]`` is the index, in
    ``store.layer_ids``, of ``wanted.layer_ids[j]``."""

    store: Layout
    wanted: Layout
    positions: tuple[int, ...]

    @property
    def identity(self) -> bool:
        """The consumer reads ``aux_hidden`` as stored."""
        return self.positions == tuple(range(len(self.store.layer_ids)))

    def columns(self, hidden_size: int) -> slice | torch.Tensor:
        """Column indices of the wanted layers in the store's ``aux_hidden``: a slice when they form
        a contiguous increasing run of the store's layers, else an int64 index tensor."""
        p, h = self.positions, hidden_size
        if p and p == tuple(range(p[0], p[0] + len(p))):
            return slice(p[0] * h, (p[0] + len(p)) * h)
        parts = [torch.arange(q * h, (q + 1) * h, dtype=torch.int64) for q in p]
        return torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)

    def aux(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """``[..., k*H]`` in the store's order -> ``[..., len(wanted)*H]`` in the wanted order."""
        if self.identity:
            return aux_hidden
        k = len(self.store.layer_ids)
        width = int(aux_hidden.shape[-1]) if aux_hidden.dim() else -1
        if k == 0 or width % k:
            raise LayoutMismatchError(f"{AUX_FIELD}: last dimension {width}, expected a multiple of "
                                      f"{k} (one hidden state per store layer id {list(self.store.layer_ids)})")
        cols = self.columns(width // k)
        if isinstance(cols, slice):
            return aux_hidden[..., cols]
        return aux_hidden.index_select(-1, cols.to(aux_hidden.device))

    def apply(self, sample: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The sample with ``aux_hidden`` selected (dropped when no layer is wanted); other fields
        untouched. The identity selection returns the sample itself."""
        if self.identity or AUX_FIELD not in sample:
            return sample if isinstance(sample, dict) else dict(sample)
        out = dict(sample)
        if not self.positions:
            del out[AUX_FIELD]
        else:
            out[AUX_FIELD] = self.aux(sample[AUX_FIELD])
        return out


def select_layout(store: Layout, wanted: Layout) -> LayoutSelection:
    """The selection serving ``wanted`` from a store of layout ``store`` (rules: module docstring)."""
    diffs = []
    if store.convention != wanted.convention:
        diffs.append(f"convention: store has {store.convention!r}, expected {wanted.convention!r}")
    if wanted.last_hidden != "none" and store.last_hidden != wanted.last_hidden:
        diffs.append(f"last_hidden: store has {store.last_hidden!r}, expected {wanted.last_hidden!r}")
    if wanted.tag and store.tag != wanted.tag:
        diffs.append(f"tag: store has {store.tag!r}, expected {wanted.tag!r}")
    missing = [i for i in wanted.layer_ids if i not in store.layer_ids]
    if missing:
        diffs.append(f"layer_ids: store has {list(store.layer_ids)}, expected {list(wanted.layer_ids)} "
                     f"(missing layer ids {missing})")
    if diffs:
        raise LayoutMismatchError(f"store layout {store.to_dict()} cannot serve the expected layout "
                                  f"{wanted.to_dict()}: " + "; ".join(diffs))
    dup = sorted({i for i in wanted.layer_ids if store.layer_ids.count(i) > 1})
    if dup:
        raise LayoutMismatchError(f"store layout layer_ids {list(store.layer_ids)}: layer ids {dup} appear more "
                                  f"than once, so the columns of {list(wanted.layer_ids)} are ambiguous")
    return LayoutSelection(store, wanted, tuple(store.layer_ids.index(i) for i in wanted.layer_ids))
