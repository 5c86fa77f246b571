"""Schema: strict definitions with messages naming field, expected and found; a stable hash; diffs."""

from __future__ import annotations

import hashlib
import json

import pytest
from conftest import make_schema

from feature_store import FieldSpec, Layout, Schema, SchemaError, standard_schema


def test_hash_is_sha256_of_canonical_json() -> None:
    s = make_schema()
    canonical = json.dumps(s.to_dict(), sort_keys=True, separators=(",", ":"))
    assert s.hash == hashlib.sha256(canonical.encode()).hexdigest()[:16]
    assert Schema.from_dict(json.loads(json.dumps(s.to_dict()))) == s
    assert Schema.from_dict(s.to_dict()).hash == s.hash
    assert make_schema("float16").hash != s.hash


def test_standard_schema_matches_the_contract() -> None:
    s = standard_schema(Layout((2, 16, 29)), hidden_size=64, vocab_size=1000, target_model_id="Qwen/x", topk=5)
    assert [(f.name, f.dtype, f.shape) for f in s.fields] == [
        ("input_ids", "int64", ()), ("loss_mask", "uint8", ()), ("aux_hidden", "bfloat16", (192,)),
        ("last_hidden", "bfloat16", (64,)), ("target_topk_ids", "int64", (5,)),
        ("target_topk_logprobs", "float32", (5,))]
    assert [f.kind for f in s.fields] == ["token_ids", "mask", None, None, "token_ids", None]
    no_last = standard_schema(Layout((2,), last_hidden="none"), hidden_size=4, vocab_size=10, target_model_id="m")
    assert "last_hidden" not in no_last.names


@pytest.mark.parametrize(("build", "message"), [
    (lambda: FieldSpec("x", "float8"), r"field 'x': dtype 'float8' unknown, expected one of"),
    (lambda: FieldSpec("x", "int64", (0,)), r"field 'x': shape \(0,\): expected positive ints"),
    (lambda: FieldSpec("offsets", "int64"), "field 'offsets': name is reserved"),
    (lambda: FieldSpec("global_step", "int64", per_token=False), "field 'global_step': name is reserved"),
    (lambda: FieldSpec("a b", "int64"), r"field name 'a b': expected an identifier"),
    (lambda: FieldSpec("x", "int64", role="ids"), r"field 'x': role 'ids', expected one of"),
    (lambda: FieldSpec("x", "int64", per_token=False, segment="window"), "a per-sample field has no segment"),
    (lambda: Layout((2, -1)), r"layout layer_ids \(2, -1\): expected non-negative ints"),
    (lambda: Layout((2,), last_hidden="final"), "layout last_hidden 'final': expected one of"),
    (lambda: Schema((FieldSpec("a", "int64"), FieldSpec("a", "int32")), Layout((1,))), r"duplicate field names \['a'\]"),
    (lambda: Schema((FieldSpec("a", "int64", per_token=False),), Layout((1,))), "at least one per-token field"),
    (lambda: Schema((FieldSpec("input_ids", "int64"),), Layout((1,))), "token-id fields need vocab_size > 0"),
    (lambda: Schema((FieldSpec("aux_hidden", "bfloat16", (12,)),), Layout((1, 2)), hidden_size=4),
     r"field 'aux_hidden': shape \(12,\), expected \(8,\) \(layer_ids=\(1, 2\), hidden_size=4\)"),
    (lambda: Schema((FieldSpec("last_hidden", "bfloat16", (4,)),), Layout((1,), last_hidden="none")),
     "field 'last_hidden' present but layout.last_hidden is 'none'"),
    (lambda: Schema.from_dict({"layout": {}}), "schema dict: missing or malformed entry"),
])
def test_invalid_definitions(build: object, message: str) -> None:
    with pytest.raises(SchemaError, match=message):
        build()  # type: ignore[operator]


def test_diff_names_each_difference() -> None:
    a = make_schema()
    b = Schema(tuple(f if f.name != "reward" else FieldSpec("reward", "float32", (2,), per_token=False)
                     for f in a.fields if f.name != "flags"), Layout((2, 4, 5), tag="eagle3"),
               "test/tiny", 1000, 8)
    assert a.diff(b) == [
        "layout: {'layer_ids': [2, 4, 5], 'convention': 'hf_hidden_states', 'last_hidden': 'post_norm', 'tag': ''}"
        " vs {'layer_ids': [2, 4, 5], 'convention': 'hf_hidden_states', 'last_hidden': 'post_norm', 'tag': 'eagle3'}",
        "field 'flags': present vs absent",
        "field 'reward' dtype: 'float64' vs 'float32'",
    ]
    assert a.diff(a) == []
