"""verl-speco-collect captures a union layout (`--layout-of eagle1,eagle3`, `--layer-ids 1,2,4,5`):
one store that every named family trains from, with exactly the features its own store would hold."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from drafters.common.target import TargetSpec
from drafters.registry import available_families, get_family, known_families
from feature_store import Layout, StoreReader, load_store
from feature_store.layout_select import select_layout
from verl_speco.capture.chat import tokenize_chat
from verl_speco.capture.collect import forward_records, main
from verl_speco.capture.records import resolve_layout, union_layout

FAMILIES = available_families()


def _chats(n: int = 6) -> list[list[dict[str, str]]]:
    g = torch.Generator().manual_seed(5)
    words = lambda k: " ".join(f"w{int(i)}" for i in torch.randint(0, 90, (k,), generator=g))  # noqa: E731
    return [[{"role": "user", "content": words(3 + i)}, {"role": "assistant", "content": words(2 + 2 * i)}]
            for i in range(n)]


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("data") / "chats.jsonl"
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in _chats()))
    return path


def _collect(target: Path, data: Path, store: Path, *how: str) -> Path:
    rc = main(["--target", str(target), "--data", str(data), "--store", str(store), "--batch-size", "4", *how])
    assert rc == 0
    return store


def _samples(store: Path) -> dict[tuple[int, ...], dict[str, torch.Tensor]]:
    with StoreReader(store, shuffle=False, prefetch=0, copy=True, verify_checksums=True, check_values=True) as r:
        it = r.iter_samples()
        return {tuple(s["input_ids"].tolist()): s for s in (next(it) for _ in range(len(r)))}


def _required(names: tuple[str, ...], hf: dict) -> list[Layout]:
    spec = TargetSpec.from_hf_config(hf)
    return [get_family(n).required_layout(get_family(n).config_cls(), spec) for n in names]


def test_union_layout_of_layouts() -> None:
    got = union_layout([("a", Layout((2, 4, 5))), ("b", Layout((), last_hidden="post_norm")),
                        ("c", Layout((5, 1), last_hidden="none"))])
    assert got == Layout((1, 2, 4, 5), last_hidden="post_norm")
    assert union_layout([("c", Layout((3,), last_hidden="none"))]).last_hidden == "none"
    with pytest.raises(ValueError, match="--layout-of 'p'.*pre_norm"):
        union_layout([("a", Layout((2,))), ("p", Layout((1,), last_hidden="pre_norm"))])


@pytest.mark.parametrize("names", [FAMILIES, FAMILIES[::-1], (FAMILIES[0],) * 2])
def test_resolve_layout_is_the_union_of_the_families(qwen3, names: tuple[str, ...]) -> None:
    hf = qwen3.config.to_dict()
    layout, required = resolve_layout(None, ",".join(names), hf)
    need = _required(names, hf)
    assert layout.layer_ids == tuple(sorted({i for lay in need for i in lay.layer_ids}))
    assert layout.last_hidden == ("post_norm" if any(lay.last_hidden == "post_norm" for lay in need) else "none")
    fields = {f for n in names for f in get_family(n).required_fields(get_family(n).config_cls())}
    assert set(required) == fields
    assert resolve_layout(None, list(names), hf) == (layout, required)


def test_a_family_without_code_fails_listing_the_implemented_ones(qwen3) -> None:
    missing = [n for n in known_families() if n not in FAMILIES]
    if not missing:
        pytest.skip("every catalog family is implemented")
    with pytest.raises(ValueError) as e:
        resolve_layout(None, f"{FAMILIES[0]},{missing[0]}", qwen3.config.to_dict())
    assert f"--layout-of {missing[0]!r}" in str(e.value) and all(n in str(e.value) for n in FAMILIES)


def test_an_unknown_family_fails_before_the_target_loads(data: Path, tmp_path: Path, capsys) -> None:
    rc = main(["--target", str(tmp_path / "no-model"), "--data", str(data), "--store", str(tmp_path / "s"),
               "--layout-of", "eagle3,nope"])
    err = capsys.readouterr().err
    assert rc == 2 and "--layout-of 'nope'" in err and "unknown drafter family" in err and "--target" not in err


def test_capture_without_layer_ids_stores_only_the_last_hidden(qwen3, tokenizer) -> None:
    chats = [tokenize_chat(tokenizer, c, [3]) for c in _chats()]
    last_only = forward_records(qwen3, chats, (), pad_id=0, dtype=torch.float32)
    full = forward_records(qwen3, chats, (2, 8), pad_id=0, dtype=torch.float32)
    for a, b in zip(last_only, full):
        assert set(a) == {"input_ids", "loss_mask", "last_hidden"}
        assert torch.equal(a["last_hidden"], b["last_hidden"])
    with pytest.raises(ValueError, match="last_hidden=False: --layout-of eagle3 needs layout"):
        resolve_layout(None, "eagle3", qwen3.config.to_dict(), last_hidden=False)


@pytest.fixture(scope="module")
def collected(target_dir: Path, data: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """`--layout-of <every family>`, `--layer-ids 1,2,4,5`, and `--layout-of <family>` for each."""
    root = tmp_path_factory.mktemp("collected")
    out = {"union": _collect(target_dir, data, root / "union", "--layout-of", ",".join(FAMILIES)),
           "explicit": _collect(target_dir, data, root / "explicit", "--layer-ids", "1,2,4,5")}
    for name in FAMILIES:
        out[name] = _collect(target_dir, data, root / name, "--layout-of", name)
    return out


def test_collect_union_serves_each_family_as_its_own_store(collected: dict[str, Path], target_dir: Path) -> None:
    """The union stores record the union layout; each family's selection from them is bit for bit
    the store `--layout-of <family>` writes from the same data."""
    hf = json.loads((target_dir / "config.json").read_text())
    need = _required(FAMILIES, hf)
    ids = tuple(sorted({i for lay in need for i in lay.layer_ids}))
    assert load_store(collected["union"]).schema.layout == Layout(ids, last_hidden="post_norm")
    assert load_store(collected["explicit"]).schema.layout == Layout((1, 2, 4, 5), last_hidden="post_norm")
    producer = json.loads((collected["union"] / "store.json").read_text())["producer"]
    assert producer["families"] == ",".join(FAMILIES)
    stores = {kind: _samples(collected[kind]) for kind in ("union", "explicit")}
    for name, lay in zip(FAMILIES, need):
        assert load_store(collected[name]).schema.layout == lay
        own = _samples(collected[name])
        for kind, samples in stores.items():
            if kind == "explicit" and not set(lay.layer_ids) <= {1, 2, 4, 5}:
                continue  # --layer-ids 1,2,4,5 holds EAGLE-3's layers, not DFlash's (2, 3, 4, 5, 6)
            sel = select_layout(load_store(collected[kind]).schema.layout, lay)
            assert samples.keys() == own.keys()
            for key, s in samples.items():
                got, ref = sel.apply(s), own[key]
                assert ("aux_hidden" in got) == bool(lay.layer_ids) == ("aux_hidden" in ref), (name, kind)
                # a family that reads no last hidden (DFlash, Domino) gets none in its own store; the union's stays
                extra = set(got) - set(ref)
                assert extra <= ({"last_hidden"} if lay.last_hidden == "none" else set()), (name, kind, extra)
                assert set(ref) <= set(got) and all(torch.equal(got[f], ref[f]) for f in ref), (name, kind)


def test_draft_train_eagle3_from_the_union_store_gives_the_exact_store_loss(collected: dict[str, Path],
                                                                            target_dir: Path, tmp_path: Path) -> None:
    """`verl-speco-draft-train` (single process) on the collected union store and on the exact
    EAGLE-3 store: the same first-step loss and tokens, bit for bit."""
    from verl_speco.train.launcher import main as train_main
    from verl_speco.train.metrics_log import read_jsonl

    first = {}
    for kind in ("explicit", "union", "eagle3"):
        out = tmp_path / kind
        rc = train_main(["--nproc-per-node", "1", f"target.path={target_dir}", f"data.store={collected[kind]}",
                         f"run.out_dir={out}", "drafter.settings.ttt_steps=2", "drafter.settings.attn_backend=sdpa",
                         "data.micro_batch_size=3", "data.prefetch=0", "run.total_steps=1", "run.device=cpu",
                         "run.progress_bar=false", "run.tensorboard=false"])
        assert rc == 0, kind
        first[kind] = read_jsonl(out / "metrics.jsonl", "train")[0]
    for kind in ("explicit", "union"):
        assert (first[kind]["loss"], first[kind]["tokens"]) == (first["eagle3"]["loss"], first["eagle3"]["tokens"])
