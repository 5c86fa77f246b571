"""fp8 (e4m3) storage of hidden-state fields (feature_store/encoding.py): round-trip error bounds against
float32 references, the store through writer, reader, inspect --strict --verify-checksums, bytes on
disk, the schema rules, and a corrupted scale refused."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch

from feature_store import ChecksumError, CorruptShardError, Layout, SchemaError, StoreReader, StoreWriter
from feature_store.encoding import FP8_MAX, decode_fp8, encode_fp8, fp8_error_bound
from feature_store.index import StoreIndex
from feature_store.inspect import main as inspect_main
from feature_store.schema import FieldSpec, Schema, scale_name, standard_schema
from feature_store.store import SHARDS_DIR, list_commits

H, V = 16, 100
LAYOUT = Layout((2, 4, 5))


def _rows(seed: int, t: int = 64, d: int = 48) -> torch.Tensor:
    """Hidden-state-like rows: normal values, a heavy tail, one huge outlier, tiny entries, a zero row."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(t, d, generator=g) * torch.rand(t, 1, generator=g).mul(30).exp()   # row scales 1..e^30
    x[:, 0] *= 50.0                                                                      # an outlier column
    x[1] = 0.0
    x[2, 3:] = 1e-7 * x[2, 3:]                                                           # tiny next to large
    return x


def test_the_worked_example_of_the_docstring() -> None:
    q, s = encode_fp8(torch.tensor([[1.0, -0.5, 0.01]]))
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert float(s) == pytest.approx(1 / 448, rel=1e-7)
    assert q.to(torch.float32).tolist() == [[448.0, -224.0, 4.5]]
    assert decode_fp8(q, s, torch.float32)[0].tolist() == pytest.approx([1.0, -0.5, 4.5 / 448], rel=1e-6)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_round_trip_within_the_stated_bound(seed: int) -> None:
    x = _rows(seed)
    q, s = encode_fp8(x)
    err = (decode_fp8(q, s, torch.float32) - x).abs()
    bound = fp8_error_bound(x)
    assert bool((err <= bound).all()), float((err - bound).max())
    assert float((err / bound).max()) > 0.5                    # the bound is tight, not vacuous
    assert float(s[1]) > 0 and bool((decode_fp8(q, s, torch.float32)[1] == 0).all())   # the zero row
    assert torch.equal(q.to(torch.float32).abs().amax(dim=1)[s > 1e-30], torch.full_like(s[s > 1e-30], FP8_MAX))


def test_a_coarser_encoding_breaks_the_bound() -> None:
    """A planted fault: rounding to 2 mantissa bits instead of 3 (what e5m2 keeps) exceeds the bound."""
    x = _rows(3)
    _, s = encode_fp8(x)
    coarse = (x / s[:, None]).to(torch.float8_e5m2).to(torch.float32) * s[:, None]
    assert bool(((coarse - x).abs() > fp8_error_bound(x)).any())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_decode_to_the_fields_dtype(dtype: torch.dtype) -> None:
    x = _rows(4, t=8)[:, :16].clamp(-6e4, 6e4)
    q, s = encode_fp8(x.to(dtype))
    out = decode_fp8(q, s, dtype)
    assert out.dtype == dtype and out.shape == x.shape
    ref = x.to(dtype).to(torch.float32)
    step = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11, torch.float32: 0.0}[dtype]   # the cast's half step
    assert bool(((out.float() - ref).abs() <= fp8_error_bound(ref) * (1 + step) + step * ref.abs()).all())


def _schema(encoding: str = "fp8_e4m3") -> Schema:
    return standard_schema(LAYOUT, hidden_size=H, vocab_size=V, target_model_id="t", hidden_encoding=encoding)


def _sample(uid: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(uid)
    t = 5 + uid % 7
    return {"input_ids": torch.randint(0, V, (t,), generator=g), "loss_mask": torch.ones(t, dtype=torch.uint8),
            "aux_hidden": (torch.randn(t, 3 * H, generator=g) * 4).to(torch.bfloat16),
            "last_hidden": torch.randn(t, H, generator=g).to(torch.bfloat16)}


def _write(root: Path, encoding: str, n: int = 12) -> Path:
    with StoreWriter(root, _schema(encoding), flush_samples=5) as w:
        for uid in range(n):
            w.add(_sample(uid), step=uid // 4)
    return root


def test_a_raw_schema_keeps_its_hash_and_fp8_is_recorded() -> None:
    raw = standard_schema(LAYOUT, hidden_size=8, vocab_size=1000, target_model_id="test/tiny")
    assert raw.hash == "25a26a12b009b03b"              # the hash before encodings existed
    assert "encoding" not in json.dumps(raw.to_dict())
    fp8 = _schema()
    assert fp8.hash != _schema("raw").hash and Schema.from_dict(fp8.to_dict()) == fp8
    assert [(f.name, f.st_dtype) for f in fp8.stored_fields] == [
        ("input_ids", "I64"), ("loss_mask", "U8"), ("aux_hidden", "F8_E4M3"), ("aux_hidden_fp8_scale", "F32"),
        ("last_hidden", "F8_E4M3"), ("last_hidden_fp8_scale", "F32")]
    fp8.check_fields([FieldSpec("aux_hidden", "bfloat16", (3 * H,))])   # a reader gets the decoded dtype


@pytest.mark.parametrize(("spec", "match"), [
    (dict(name="ids", dtype="int64", encoding="fp8_e4m3"), "dtype 'int64'"),
    (dict(name="r", dtype="float32", shape=(2,), per_token=False, encoding="fp8_e4m3"), "per_token=False"),
    (dict(name="x", dtype="bfloat16", encoding="fp8_e4m3"), r"shape \(\)"),
    (dict(name="x", dtype="bfloat16", shape=(4,), encoding="int4"), "encoding 'int4'"),
])
def test_bad_encodings_are_refused_naming_the_field(spec: dict, match: str) -> None:
    with pytest.raises(SchemaError, match=match):
        FieldSpec(**spec)


def test_a_field_named_like_a_scale_is_refused() -> None:
    with pytest.raises(SchemaError, match="aux_hidden_fp8_scale"):
        standard_schema(LAYOUT, hidden_size=H, vocab_size=V, target_model_id="t", hidden_encoding="fp8_e4m3",
                        extra=[FieldSpec(scale_name("aux_hidden"), "float32")])


def test_store_round_trip_bytes_and_inspect(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    raw, fp8 = _write(tmp_path / "raw", "raw"), _write(tmp_path / "fp8", "fp8_e4m3")
    with StoreReader(fp8, shuffle=False, prefetch=0, verify_checksums=True) as reader:
        assert len(reader) == 12
        for uid, sample in zip(range(len(reader)), reader.iter_samples()):
            want = _sample(uid)
            assert torch.equal(sample["input_ids"], want["input_ids"])
            for name in ("aux_hidden", "last_hidden"):
                ref = want[name].float()
                assert sample[name].dtype == torch.bfloat16 and sample[name].shape == ref.shape
                err = (sample[name].float() - ref).abs()
                assert bool((err <= fp8_error_bound(ref) + 2.0 ** -8 * sample[name].float().abs()).all())
    # tensor bytes per token (headers apart): raw 8 (ids) + 1 (mask) + 2 * 64 (bf16 aux + last) = 137;
    # fp8 9 + 64 + two 4-byte scales = 81, plus the same 16 bytes of per-sample scalars and offsets
    tokens = sum(c.num_tokens for c in list_commits(raw))
    per_token = {root.name: _tensor_bytes(root) / tokens for root in (raw, fp8)}
    assert per_token["fp8"] == pytest.approx(per_token["raw"] - 56, abs=1e-9) and per_token["fp8"] < 0.65 * per_token["raw"]
    capsys.readouterr()
    assert inspect_main([str(fp8), "--strict", "--verify-checksums", "--json"]) == 0
    fields = {f["name"]: f for f in json.loads(capsys.readouterr().out)["summary"]["fields"]}
    assert (fields["aux_hidden"]["encoding"], fields["aux_hidden"]["stored_row_bytes"]) == ("fp8_e4m3", 3 * H + 4)
    assert (fields["input_ids"]["encoding"], fields["input_ids"]["stored_row_bytes"]) == ("raw", 8)
    assert inspect_main([str(fp8)]) == 0
    assert "fp8_e4m3, 52 B/token" in capsys.readouterr().out


def _tensor_bytes(store: Path) -> int:
    """Bytes of tensor data (after each shard's header) in the store's committed shards."""
    total = 0
    for c in list_commits(store):
        raw = (store / SHARDS_DIR / c.shard).read_bytes()
        total += len(raw) - 8 - struct.unpack("<Q", raw[:8])[0]
    return total


def _scale_offset(shard: Path, name: str) -> int:
    """The file offset of the first float32 scale of field `name` in `shard`."""
    raw = shard.read_bytes()
    (hlen,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8: 8 + hlen])
    return 8 + hlen + header[scale_name(name)]["data_offsets"][0]


@pytest.mark.parametrize("value", [float("nan"), float("inf"), 0.0, -1.0])
def test_a_corrupted_scale_is_refused(tmp_path: Path, value: float, capsys: pytest.CaptureFixture[str]) -> None:
    store = _write(tmp_path / "s", "fp8_e4m3")
    shard = store / SHARDS_DIR / list_commits(store)[0].shard
    with open(shard, "r+b") as f:
        f.seek(_scale_offset(shard, "aux_hidden"))
        f.write(struct.pack("<f", value))
    index = StoreIndex.open(store)                      # no checksum pass: the scale check alone
    with pytest.raises(CorruptShardError, match=r"field 'aux_hidden' of sample 0: 1 fp8 scale\(s\) not finite and > 0"):
        index.sample(0)
    index.sample(1)                                     # the other samples stay readable
    capsys.readouterr()
    assert inspect_main([str(store), "--json"]) == 1
    kinds = [e["kind"] for e in json.loads(capsys.readouterr().out)["errors"]]
    assert "bad_scale" in kinds


def test_a_plausible_corrupted_scale_is_caught_by_the_checksum(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    store = _write(tmp_path / "s", "fp8_e4m3")
    shard = store / SHARDS_DIR / list_commits(store)[0].shard
    at = _scale_offset(shard, "last_hidden")
    with open(shard, "r+b") as f:
        f.seek(at)
        (scale,) = struct.unpack("<f", f.read(4))
        f.seek(at)
        f.write(struct.pack("<f", scale * 2))          # finite and positive: decodes, twice too large
    with pytest.raises(ChecksumError):
        StoreIndex.open(store, verify_checksums=True).sample(0)
    capsys.readouterr()
    assert inspect_main([str(store), "--strict", "--verify-checksums", "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["ok"] is False


def test_a_non_finite_feature_is_refused_before_encoding(tmp_path: Path) -> None:
    from feature_store import NonFiniteError

    sample = _sample(0)
    sample["last_hidden"][2, 3] = float("inf")
    with StoreWriter(tmp_path, _schema()) as w, pytest.raises(NonFiniteError, match="'last_hidden'"):
        w.add(sample, step=0)


def test_transcode_keeps_samples_order_steps_and_shards(tmp_path: Path) -> None:
    from feature_store.transcode import transcode_store

    src = _write(tmp_path / "raw", "raw")
    assert transcode_store(src, tmp_path / "fp8", "fp8_e4m3") == 12
    a, b = StoreIndex.open(src), StoreIndex.open(tmp_path / "fp8", verify_checksums=True)
    assert [c.num_samples for c in a.commits] == [c.num_samples for c in b.commits] == [5, 5, 2]
    assert b.schema.field("last_hidden").encoding == "fp8_e4m3" and b.schema.field("input_ids").encoding == "raw"
    for g in range(12):
        x, y = a.sample(g), b.sample(g)
        assert [int(x[k]) for k in ("global_step", "policy_version")] == [int(y[k]) for k in ("global_step", "policy_version")]
        assert torch.equal(x["input_ids"], y["input_ids"]) and torch.equal(x["loss_mask"], y["loss_mask"])
        ref = x["aux_hidden"].float()
        assert bool(((y["aux_hidden"].float() - ref).abs() <= fp8_error_bound(ref) + 2.0 ** -8 * ref.abs() * 1.1).all())
    with pytest.raises(Exception, match="already there"):
        transcode_store(src, tmp_path / "fp8", "fp8_e4m3")
    with pytest.raises(ValueError, match="encoding='fp4'"):
        transcode_store(src, tmp_path / "x", "fp4")
