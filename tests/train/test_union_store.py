"""One store for every family: the trainer reads a family's layers out of a store captured with more.

The union stores hold the same samples as conftest's exact EAGLE-3 store (layers 2, 4, 5, same
generator), plus an extra layer 1, in the store's increasing order (1, 2, 4, 5) or reversed
(5, 4, 2, 1: a gather, not a slice). Reading EAGLE-3's columns out of them must give exactly the
exact store's samples, hence the same first-step loss of `verl-speco-draft-train`."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from conftest import HIDDEN, LAYOUT, VOCAB, make_sample, write_store

from drafters.registry import available_families, get_family
from feature_store import Layout, LayoutMismatchError, StoreWriter, standard_schema
from feature_store.store import list_commits
from verl_speco.train.config import DataSection
from verl_speco.train.data import eval_batches, micro_batches, open_eval_index, open_train_reader
from verl_speco.train.launcher import main as train_main
from verl_speco.train.metrics_log import read_jsonl

FIELDS = ("input_ids", "loss_mask", "aux_hidden", "last_hidden")
NUM_SAMPLES = 32


def write_union_store(root: Path, layer_ids: tuple[int, ...], seed: int = 0) -> Path:
    """conftest.write_store's samples with aux_hidden at `layer_ids` (a superset of (2, 4, 5), or
    not: a missing id is just left out); layer 1 gets its own table."""
    g = torch.Generator().manual_seed(seed)
    tables = torch.randn(4, VOCAB, HIDDEN, generator=torch.Generator().manual_seed(99))
    extra = torch.randn(VOCAB, HIDDEN, generator=torch.Generator().manual_seed(7))
    schema = standard_schema(Layout(layer_ids=layer_ids, last_hidden="post_norm"), hidden_size=HIDDEN,
                             vocab_size=VOCAB, target_model_id="tiny-test")
    with StoreWriter(root, schema, rank=0, flush_samples=8) as w:
        for _ in range(NUM_SAMPLES):
            s = make_sample(g, int(torch.randint(8, 25, (1,), generator=g)), tables)
            blocks = dict(zip(LAYOUT.layer_ids, s["aux_hidden"].split(HIDDEN, dim=-1)))
            blocks[1] = extra[s["input_ids"]].to(torch.bfloat16)
            s["aux_hidden"] = torch.cat([blocks[i] for i in layer_ids], dim=-1)
            w.add(s, step=0)
    return root


@pytest.fixture(scope="module")
def stores(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("union")
    return {"exact": write_store(base / "exact", NUM_SAMPLES),
            "union": write_union_store(base / "union", (1, 2, 4, 5)),
            "reversed": write_union_store(base / "reversed", (5, 4, 2, 1)),
            "lacking": write_union_store(base / "lacking", (1, 2, 5))}


def _data(store: Path, **kw: object) -> DataSection:
    return DataSection(store=str(store), shuffle=True, seed=3, prefetch=0, micro_batch_size=3,
                       max_seq_len=16, verify_checksums=True, **kw)  # type: ignore[arg-type]


def _stream(store: Path, n: int, layout: Layout | None) -> list[list[dict[str, torch.Tensor]]]:
    cfg = _data(store)
    reader = open_train_reader(cfg, 0, 1, LAYOUT, FIELDS, None)
    it = micro_batches(reader, cfg, layout)
    out = [[{k: v.clone() for k, v in s.items()} for s in next(it)] for _ in range(n)]  # views die with the reader
    reader.close()
    return out


@pytest.mark.parametrize("kind", ["union", "reversed"])
def test_the_data_path_yields_exactly_the_family_columns(stores: dict[str, Path], kind: str) -> None:
    golden = _stream(stores["exact"], 12, None)          # the exact store as stored (more than an epoch)
    got = _stream(stores[kind], 12, LAYOUT)
    for batch_g, batch in zip(golden, got):
        for sg, s in zip(batch_g, batch):
            assert s.keys() == sg.keys()
            assert all(torch.equal(s[k], sg[k]) for k in sg), kind   # aux_hidden [T, 3*H] bit for bit
    cfg = _data(stores[kind], eval_samples=4)
    index = open_eval_index(cfg, list_commits(stores[kind])[-1:], LAYOUT, FIELDS)
    exact = open_eval_index(_data(stores["exact"], eval_samples=4), list_commits(stores["exact"])[-1:], LAYOUT, FIELDS)
    assert index is not None and exact is not None
    for s, sg in zip(next(eval_batches(index, cfg, 0, 1, LAYOUT)), next(eval_batches(exact, cfg, 0, 1))):
        assert torch.equal(s["aux_hidden"], sg["aux_hidden"]) and s["aux_hidden"].shape[-1] == 3 * HIDDEN
    index.close()
    exact.close()


def test_an_exact_store_is_read_unchanged(stores: dict[str, Path]) -> None:
    as_stored, selected = _stream(stores["exact"], 4, None), _stream(stores["exact"], 4, LAYOUT)
    for batch_g, batch in zip(as_stored, selected):
        for sg, s in zip(batch_g, batch):
            assert s.keys() == sg.keys() and all(torch.equal(s[k], sg[k]) for k in sg)


def test_a_store_lacking_a_layer_fails_naming_it(stores: dict[str, Path]) -> None:
    with pytest.raises(LayoutMismatchError) as e:
        open_train_reader(_data(stores["lacking"]), 0, 1, LAYOUT, FIELDS, None)
    assert str(stores["lacking"]) in str(e.value) and "missing layer ids [4]" in str(e.value)


def _train(target: Path, store: Path, out: Path, *extra: str, options: tuple[str, ...] = ()) -> int:
    return train_main(["--nproc-per-node", "1", *options, f"target.path={target}", f"data.store={store}",
                       f"run.out_dir={out}", "data.micro_batch_size=4", "data.eval_fraction=0.25",
                       "data.eval_samples=8", "data.prefetch=0", "run.total_steps=1", "run.save_every=1",
                       "run.device=cpu", "run.progress_bar=false", "run.tensorboard=false", *extra])


EAGLE3 = ("drafter.settings.ttt_steps=2", "drafter.settings.attn_backend=sdpa")


def test_draft_train_from_a_union_store_gives_the_exact_store_loss(stores: dict[str, Path], tiny_target: Path,
                                                                   tmp_path: Path) -> None:
    records = {}
    for kind in ("exact", "union", "reversed"):
        assert _train(tiny_target, stores[kind], tmp_path / kind, *EAGLE3) == 0
        records[kind] = (read_jsonl(tmp_path / kind / "metrics.jsonl", "train")[0],
                         read_jsonl(tmp_path / kind / "metrics.jsonl", "eval")[0])
    (train, ev) = records["exact"]
    for kind in ("union", "reversed"):
        assert records[kind][0]["loss"] == train["loss"] and records[kind][0]["tokens"] == train["tokens"], kind
        assert records[kind][1]["loss"] == ev["loss"], kind


def test_draft_train_from_a_store_lacking_a_layer_is_one_error_line(stores: dict[str, Path], tiny_target: Path,
                                                                    tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert _train(tiny_target, stores["lacking"], tmp_path / "out", *EAGLE3) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("verl-speco-draft-train: error: data.store=")
    assert "missing layer ids [4]" in err[0] and "[1, 2, 5]" in err[0] and "[2, 4, 5]" in err[0]


@pytest.mark.parametrize("name", available_families())
def test_every_available_family_reads_its_layers_from_the_union_store(name: str, stores: dict[str, Path],
                                                                      tiny_target: Path) -> None:
    """Each family whose layers the union store holds (EAGLE-3: 2, 4, 5; EAGLE-1: none, only the
    last hidden) gets from the data path exactly its layers (EAGLE-1: no aux_hidden at all), and its
    own collate + objective run on them and give the loss of the same batch built by hand."""
    from drafters.common.target import TargetHead

    target = TargetHead.from_pretrained(tiny_target)
    family = get_family(name)
    cfg = family.config_cls()
    if dataclasses.is_dataclass(cfg) and "attn_backend" in {f.name for f in dataclasses.fields(cfg)}:
        cfg = dataclasses.replace(cfg, attn_backend="sdpa")  # type: ignore[type-var]
    if getattr(cfg, "mask_token_id", 0) is None and target.spec.mask_token_id is None:
        cfg = dataclasses.replace(cfg, mask_token_id=target.spec.vocab_size - 1)  # type: ignore[type-var]  # no tokenizer mask
    need, fields = family.required_layout(cfg, target.spec), tuple(family.required_fields(cfg))
    if not set(need.layer_ids) <= {1, 2, 4, 5}:
        pytest.skip(f"{name} reads layers {need.layer_ids}, not all in the union store")
    data = _data(stores["union"])
    readers = [open_train_reader(data, 0, 1, need, fields, None) for _ in range(2)]
    batch = next(micro_batches(readers[0], data, need))
    golden = []
    for r in next(micro_batches(readers[1], data)):   # as stored; the family's columns cut by hand
        blocks = dict(zip((1, 2, 4, 5), r["aux_hidden"].split(HIDDEN, dim=-1)))
        g = {k: v for k, v in r.items() if k != "aux_hidden"}
        if need.layer_ids:
            g["aux_hidden"] = torch.cat([blocks[i] for i in need.layer_ids], dim=-1).contiguous()
        golden.append(g)
    for s, g in zip(batch, golden):
        assert s.keys() == g.keys() and all(torch.equal(s[k], g[k]) for k in g), name
        assert set(fields) <= set(s) and ("aux_hidden" in s) == bool(need.layer_ids)
    torch.manual_seed(0)
    model = family.build(cfg, target, None)
    model.eval()
    torch.manual_seed(1)   # families that draw (P-EAGLE's COD sampling) see the same draw in both calls
    out = family.objective(model, family.collate(batch))
    torch.manual_seed(1)
    ref = family.objective(model, family.collate(golden))
    assert torch.isfinite(out.loss()) and torch.equal(out.loss(), ref.loss())
    for reader in readers:
        reader.close()
