"""select_layout: a store captured with the union of several families' layers serves each of them.

The hand-made store holds layers (1, 2, 4, 5); every hidden value encodes its layer id, token and
column (``1000 * id + 10 * t + c``, exact in float32), so a wrong column slice is visible."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from feature_store import (
    Layout,
    LayoutMismatchError,
    SchemaError,
    StoreReader,
    StoreWriter,
    load_store,
    standard_schema,
)
from feature_store.layout_select import select_layout

UNION = Layout(layer_ids=(1, 2, 4, 5), last_hidden="post_norm")
H, V = 4, 50


def layer_block(layer: int, t: int) -> torch.Tensor:
    """[t, H]: the hidden state 'of layer `layer`' (values name the layer, token and column)."""
    return 1000.0 * layer + 10.0 * torch.arange(t)[:, None] + torch.arange(H)[None, :]


def sample(t: int, layers: tuple[int, ...]) -> dict[str, torch.Tensor]:
    out = {"input_ids": torch.arange(t) % V, "loss_mask": torch.ones(t, dtype=torch.uint8),
           "last_hidden": -layer_block(99, t)}
    if layers:
        out["aux_hidden"] = torch.cat([layer_block(i, t) for i in layers], dim=-1)
    return out


def write(root: Path, layout: Layout, lengths: tuple[int, ...] = (3, 5, 2)) -> Path:
    schema = standard_schema(layout, hidden_size=H, vocab_size=V, target_model_id="m", hidden_dtype="float32")
    with StoreWriter(root, schema, rank=0) as w:
        for t in lengths:
            w.add(sample(t, layout.layer_ids), step=0)
    return root


def read(root: Path) -> list[dict[str, torch.Tensor]]:
    with StoreReader(root, shuffle=False, prefetch=0, copy=True) as reader:
        it = reader.iter_samples()
        return [next(it) for _ in range(len(reader))]


@pytest.fixture()
def union_store(tmp_path: Path) -> Path:
    return write(tmp_path / "union", UNION)


@pytest.mark.parametrize("wanted", [(2, 4, 5), (5, 2), (1,), (4, 1), (1, 2, 4, 5), (2, 4)])
def test_selection_yields_the_wanted_layers_in_the_wanted_order(union_store: Path, wanted: tuple[int, ...]) -> None:
    read_layout = load_store(union_store).schema.layout
    sel = select_layout(read_layout, Layout(layer_ids=wanted, last_hidden="post_norm"))
    assert sel.positions == tuple(UNION.layer_ids.index(i) for i in wanted)
    for s in read(union_store):
        t = s["input_ids"].shape[0]
        got = sel.apply(s)
        golden = torch.cat([layer_block(i, t) for i in wanted], dim=-1)   # [T, len(wanted) * H]
        assert torch.equal(got["aux_hidden"], golden), wanted
        assert torch.equal(sel.aux(s["aux_hidden"]), golden)
        assert got["last_hidden"] is s["last_hidden"] and got["input_ids"] is s["input_ids"]


def test_columns_are_a_view_for_a_contiguous_run_else_a_gather() -> None:
    assert select_layout(UNION, Layout((2, 4, 5))).columns(H) == slice(H, 4 * H)
    cols = select_layout(UNION, Layout((5, 2))).columns(H)
    assert isinstance(cols, torch.Tensor)
    assert cols.tolist() == list(range(3 * H, 4 * H)) + list(range(H, 2 * H))
    aux = torch.cat([layer_block(i, 3) for i in UNION.layer_ids], dim=-1)
    view = select_layout(UNION, Layout((2, 4, 5))).aux(aux)
    assert view.data_ptr() == aux.data_ptr() + H * aux.element_size()       # no copy


def test_the_identity_selection_returns_the_sample_itself(tmp_path: Path) -> None:
    exact = Layout(layer_ids=(2, 4, 5), last_hidden="post_norm")
    root = write(tmp_path / "exact", exact)
    sel = select_layout(exact, Layout(layer_ids=(2, 4, 5)))
    assert sel.identity
    for s in read(root):
        assert sel.apply(s) is s and sel.aux(s["aux_hidden"]) is s["aux_hidden"]


def test_missing_layers_fail_naming_them_and_both_layouts(union_store: Path) -> None:
    store_layout = load_store(union_store).schema.layout
    with pytest.raises(LayoutMismatchError) as e:
        select_layout(store_layout, Layout(layer_ids=(2, 3, 5, 7)))
    msg = str(e.value)
    assert "missing layer ids [3, 7]" in msg and "[1, 2, 4, 5]" in msg and "[2, 3, 5, 7]" in msg


@pytest.mark.parametrize(("store", "wanted", "needle"), [
    (Layout((1, 2), last_hidden="none"), Layout((1,), last_hidden="post_norm"),
     "last_hidden: store has 'none', expected 'post_norm'"),
    (Layout((1, 2), last_hidden="pre_norm"), Layout((1,), last_hidden="post_norm"),
     "last_hidden: store has 'pre_norm', expected 'post_norm'"),
    (Layout((1, 2), convention="sglang"), Layout((1,)), "convention: store has 'sglang', expected 'hf_hidden_states'"),
    (Layout((1, 2), tag="a"), Layout((1,), tag="b"), "tag: store has 'a', expected 'b'"),
    (Layout((1, 2, 1)), Layout((1,)), "layer ids [1] appear more than once"),
])
def test_incompatible_layouts_fail_naming_the_entry(store: Layout, wanted: Layout, needle: str) -> None:
    with pytest.raises(LayoutMismatchError) as e:
        select_layout(store, wanted)
    assert needle in str(e.value)


def test_a_layout_without_last_hidden_or_tag_is_served_by_a_store_with_them() -> None:
    sel = select_layout(Layout((1, 2), last_hidden="post_norm", tag="union"), Layout((2,), last_hidden="none"))
    assert sel.positions == (1,)


def test_an_empty_layout_is_valid_and_served_by_a_union_store(union_store: Path, tmp_path: Path) -> None:
    last_only = Layout(layer_ids=(), last_hidden="post_norm")          # what EAGLE-1 reads
    schema = standard_schema(last_only, hidden_size=H, vocab_size=V, target_model_id="m")
    assert schema.names == ("input_ids", "loss_mask", "last_hidden")
    sel = select_layout(UNION, last_only)
    for s in read(union_store):
        got = sel.apply(s)
        assert "aux_hidden" not in got and "aux_hidden" in s
        assert torch.equal(got["last_hidden"], s["last_hidden"])
    # a store of the empty layout itself (no aux_hidden field) round-trips and serves it unchanged
    root = write(tmp_path / "last_only", last_only)
    stored = read(root)
    assert [tuple(s) for s in stored][0] == ("input_ids", "loss_mask", "last_hidden", "global_step", "policy_version")
    assert all(select_layout(last_only, last_only).apply(s) is s for s in stored)
    with pytest.raises(LayoutMismatchError, match=r"missing layer ids \[2\]"):
        select_layout(last_only, Layout((2,)))


def test_an_aux_width_that_is_not_k_hidden_states_fails() -> None:
    with pytest.raises(LayoutMismatchError, match="multiple of 4"):
        select_layout(UNION, Layout((2,))).aux(torch.zeros(3, 10))
    with pytest.raises(SchemaError, match="layer_ids"):
        Layout(layer_ids=(-1,))
