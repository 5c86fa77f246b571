"""Shared helpers: a schema with every dtype and both field kinds, deterministic samples keyed by a uid.

``make_sample(uid)`` is a pure function of ``uid`` (length, values), so a test can recompute what any
stored sample must contain from its ``uid`` field alone.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from feature_store import FieldSpec, Layout, Schema, StoreReader, StoreWriter

LAYOUT = Layout(layer_ids=(2, 4, 5), last_hidden="post_norm")
H, V = 8, 1000


def make_schema(hidden_dtype: str = "bfloat16", layout: Layout = LAYOUT) -> Schema:
    return Schema(
        fields=(
            FieldSpec("input_ids", "int32"),
            FieldSpec("loss_mask", "uint8"),
            FieldSpec("aux_hidden", hidden_dtype, (3 * H,)),
            FieldSpec("last_hidden", "float16", (H,)),
            FieldSpec("target_topk_ids", "int64", (4,)),
            FieldSpec("target_topk_logprobs", "float32", (4,)),
            FieldSpec("flags", "bool"),
            FieldSpec("win_hidden", "float64", (5,), segment="window"),
            FieldSpec("uid", "int64", (), per_token=False),
            FieldSpec("reward", "float64", (2,), per_token=False),
            FieldSpec("bucket", "int8", (), per_token=False),
        ),
        layout=layout, target_model_id="test/tiny", vocab_size=V, hidden_size=H)


def make_sample(uid: int, max_len: int = 40, schema: Schema | None = None) -> dict[str, torch.Tensor]:
    """Sample ``uid`` as the writer receives it (tensors already in the schema's dtypes)."""
    schema = schema or make_schema()
    g = torch.Generator().manual_seed(uid)
    t = int(torch.randint(1, max_len + 1, (1,), generator=g))
    w = int(torch.randint(0, t + 1, (1,), generator=g))
    mask = (torch.rand(t, generator=g) < 0.5).to(torch.uint8)
    mask[int(torch.randint(0, t, (1,), generator=g))] = 1
    out = {
        "input_ids": torch.randint(0, V, (t,), generator=g, dtype=torch.int32),
        "loss_mask": mask,
        "aux_hidden": torch.randn(t, 3 * H, generator=g),
        "last_hidden": torch.randn(t, H, generator=g).to(torch.float16),
        "target_topk_ids": torch.randint(0, V, (t, 4), generator=g),
        "target_topk_logprobs": torch.randn(t, 4, generator=g),
        "flags": torch.rand(t, generator=g) < 0.3,
        "win_hidden": torch.randn(w, 5, generator=g, dtype=torch.float64),
        "uid": torch.tensor(uid, dtype=torch.int64),
        "reward": torch.randn(2, generator=g, dtype=torch.float64),
        "bucket": torch.tensor(uid % 100 - 50, dtype=torch.int8),
    }
    out["aux_hidden"] = out["aux_hidden"].to(schema.field("aux_hidden").torch_dtype)
    return out


def assert_bit_equal(found: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    for name, e in expected.items():
        f = found[name]
        assert f.dtype == e.dtype and f.shape == e.shape, (name, f.dtype, e.dtype, f.shape, e.shape)
        if e.is_floating_point():   # bit-exact: compare the raw bits
            ints = {2: torch.int16, 4: torch.int32, 8: torch.int64}[e.element_size()]
            assert torch.equal(f.contiguous().view(ints), e.contiguous().view(ints)), name
        else:
            assert torch.equal(f, e), name


def write_store(root: Path, uids: list[int], *, rank: int = 0, flush_samples: int = 7,
                **kw: object) -> StoreWriter:
    with StoreWriter(root, make_schema(), rank=rank, flush_samples=flush_samples, **kw) as w:  # type: ignore[arg-type]
        for u in uids:
            w.add(make_sample(u), step=u // 10, policy_version=u // 20)
    return w


def read_uids(root: Path, **kw: object) -> list[int]:
    """All uids of one pass over the store in storage order (world size 1, no shuffle)."""
    r = StoreReader(root, shuffle=False, prefetch=0, **kw)  # type: ignore[arg-type]
    it = r.iter_samples()
    out = [int(next(it)["uid"]) for _ in range(len(r))]
    r.close()
    return out


@pytest.fixture
def store(tmp_path: Path) -> Path:
    """A store of 50 samples (uids 0..49) in 8 shards."""
    write_store(tmp_path / "store", list(range(50)))
    return tmp_path / "store"
