"""Schema of a Feature Store: named fields (dtype, trailing shape, per-token or per-sample), a layout tag
and the target model's identity. A schema is hashed from its canonical JSON; writers, shards and
readers compare hashes and, when they differ, report the differing entries by name.

Shapes: a per-token field ``FieldSpec("aux_hidden", "bfloat16", (k * H,))`` holds ``[T, k*H]`` per
sample (``T`` = the sample's length in the field's ``segment``); a per-sample field
``FieldSpec("reward", "float32", (), per_token=False)`` holds ``[]`` per sample."""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from dataclasses import field as dc_field
from typing import Any

import torch

from feature_store.errors import LayoutMismatchError, SchemaError

SCHEMA_VERSION = 1
# dtype name -> (torch dtype, safetensors dtype code)
DTYPES: dict[str, tuple[torch.dtype, str]] = {
    "bool": (torch.bool, "BOOL"), "uint8": (torch.uint8, "U8"), "int8": (torch.int8, "I8"),
    "int16": (torch.int16, "I16"), "int32": (torch.int32, "I32"), "int64": (torch.int64, "I64"),
    "float16": (torch.float16, "F16"), "bfloat16": (torch.bfloat16, "BF16"),
    "float32": (torch.float32, "F32"), "float64": (torch.float64, "F64"),
    "float8_e4m3fn": (torch.float8_e4m3fn, "F8_E4M3"),
}
# how a floating per-token field is stored: "raw" (its dtype) or "fp8_e4m3" (encoding.py: e4m3 values
# plus a float32 scale per token, stored as a second tensor named by `scale_name`)
ENCODINGS = ("raw", "fp8_e4m3")
ENCODABLE = ("bfloat16", "float16", "float32")
TORCH_TO_NAME = {v[0]: k for k, v in DTYPES.items()}
LAST_HIDDEN_KINDS = ("post_norm", "pre_norm", "none")
TOKENS = "tokens"                                  # the main per-token segment (sequence length)
STORE_SCALARS = ("global_step", "policy_version")  # per-sample int64 kept by the store itself
ROLES = ("token_ids", "mask")
ROLE_BY_NAME = {"input_ids": "token_ids", "target_topk_ids": "token_ids", "loss_mask": "mask"}
_NAME_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def offsets_name(segment: str) -> str:
    """Name of a segment's offsets tensor in a shard: ``offsets`` for ``tokens``, else ``offsets.<seg>``."""
    return "offsets" if segment == TOKENS else f"offsets.{segment}"


@dataclass(frozen=True)
class FieldSpec:
    """One stored field. ``shape`` is the trailing shape (after the token axis when ``per_token``).

    ``segment`` groups per-token fields sharing one length (default ``"tokens"``; e.g. a capture
    ``"window"`` when only part of the sequence carries features). ``role`` enables value checks:
    ``"token_ids"`` (``0 <= id < vocab_size``) or ``"mask"`` (0/1, not all 0); ``None`` infers it from
    the name (``input_ids``/``target_topk_ids`` -> token_ids, ``loss_mask`` -> mask)."""

    name: str
    dtype: str
    shape: tuple[int, ...] = ()
    per_token: bool = True
    segment: str = TOKENS
    role: str | None = None
    encoding: str = "raw"

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(self.shape))
        if not isinstance(self.name, str) or not _NAME_RE.match(self.name):
            raise SchemaError(f"field name {self.name!r}: expected an identifier ([A-Za-z_][A-Za-z0-9_]*)")
        if self.name in STORE_SCALARS or self.name == "offsets":
            raise SchemaError(f"field {self.name!r}: name is reserved by the store "
                              f"(reserved: offsets, {', '.join(STORE_SCALARS)})")
        if self.dtype not in DTYPES:
            raise SchemaError(f"field {self.name!r}: dtype {self.dtype!r} unknown, expected one of {sorted(DTYPES)}")
        if not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in self.shape):
            raise SchemaError(f"field {self.name!r}: shape {self.shape}: expected positive ints")
        if not _NAME_RE.match(self.segment):
            raise SchemaError(f"field {self.name!r}: segment {self.segment!r}: expected an identifier")
        if not self.per_token and self.segment != TOKENS:
            raise SchemaError(f"field {self.name!r}: a per-sample field has no segment (found {self.segment!r})")
        if self.role is None:
            object.__setattr__(self, "role", ROLE_BY_NAME.get(self.name))
        if self.role is not None and self.role not in ROLES:
            raise SchemaError(f"field {self.name!r}: role {self.role!r}, expected one of {ROLES} or None")
        if self.encoding not in ENCODINGS:
            raise SchemaError(f"field {self.name!r}: encoding {self.encoding!r}, expected one of {ENCODINGS}")
        if self.encoding != "raw" and not (self.per_token and self.shape and self.dtype in ENCODABLE):
            raise SchemaError(f"field {self.name!r}: encoding {self.encoding!r} applies to a per-token field of "
                              f"dtype {'/'.join(ENCODABLE)} with a trailing shape; found dtype {self.dtype!r}, "
                              f"shape {self.shape}, per_token={self.per_token}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype][0]

    @property
    def st_dtype(self) -> str:
        return DTYPES[self.dtype][1]

    @property
    def kind(self) -> str | None:
        """The effective role (explicit ``role``, else the one implied by the name, resolved at init)."""
        return self.role

    @property
    def row_nbytes(self) -> int:
        """Bytes of one token row (per-token) or of one sample (per-sample), in ``dtype``."""
        n = self.torch_dtype.itemsize
        for d in self.shape:
            n *= d
        return n

    @property
    def stored(self) -> tuple[FieldSpec, ...]:
        """The tensors this field is stored as in a shard: itself when raw; for ``fp8_e4m3`` the e4m3
        values ``[T, *shape]`` under its own name and the float32 scales ``[T]`` under ``scale_name``."""
        if self.encoding == "raw":
            return (self,)
        return (FieldSpec(self.name, "float8_e4m3fn", self.shape, True, self.segment),
                FieldSpec(scale_name(self.name), "float32", (), True, self.segment))

    @property
    def stored_row_nbytes(self) -> int:
        """Bytes one token row (per-token) or one sample (per-sample) takes on disk."""
        return sum(f.row_nbytes for f in self.stored)

    def to_dict(self) -> dict[str, Any]:
        d = {"name": self.name, "dtype": self.dtype, "shape": list(self.shape), "per_token": self.per_token,
             "segment": self.segment, "role": self.kind}
        if self.encoding != "raw":   # only when set: a raw store's schema hash is what it always was
            d["encoding"] = self.encoding
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> FieldSpec:
        return cls(d["name"], d["dtype"], tuple(d["shape"]), bool(d["per_token"]), d.get("segment", TOKENS),
                   d.get("role"), d.get("encoding", "raw"))


def scale_name(field_name: str) -> str:
    """The shard tensor holding an ``fp8_e4m3`` field's per-token scales: ``aux_hidden`` -> ``aux_hidden_fp8_scale``
    (a schema refuses a field of that name next to the encoded one)."""
    return f"{field_name}_fp8_scale"


@dataclass(frozen=True)
class Layout:
    """What the hidden states are: ``layer_ids`` in ``convention`` (HF ``hidden_states`` indexing:
    0 = embeddings, i = output of decoder layer i-1), and what ``last_hidden`` holds."""

    layer_ids: tuple[int, ...]
    convention: str = "hf_hidden_states"
    last_hidden: str = "post_norm"
    tag: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "layer_ids", tuple(self.layer_ids))
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in self.layer_ids):
            raise SchemaError(f"layout layer_ids {self.layer_ids}: expected non-negative ints")
        if self.last_hidden not in LAST_HIDDEN_KINDS:
            raise SchemaError(f"layout last_hidden {self.last_hidden!r}: expected one of {LAST_HIDDEN_KINDS}")
        if not self.convention:
            raise SchemaError("layout convention: expected a non-empty name (e.g. 'hf_hidden_states')")

    def to_dict(self) -> dict[str, Any]:
        return {"layer_ids": list(self.layer_ids), "convention": self.convention,
                "last_hidden": self.last_hidden, "tag": self.tag}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Layout:
        return cls(tuple(d["layer_ids"]), d["convention"], d["last_hidden"], d.get("tag", ""))

    def check_matches(self, expected: Layout) -> None:
        """Raise ``LayoutMismatchError`` naming every differing entry (store vs expected)."""
        diffs = [f"{k}: store has {v!r}, expected {expected.to_dict()[k]!r}"
                 for k, v in self.to_dict().items() if expected.to_dict()[k] != v]
        if diffs:
            raise LayoutMismatchError(f"store layout {self.to_dict()} differs from the expected layout "
                                      f"{expected.to_dict()}: " + "; ".join(diffs))


@dataclass(frozen=True)
class Schema:
    """Fields + layout + target identity. ``hash`` is stable across processes and machines."""

    fields: tuple[FieldSpec, ...]
    layout: Layout
    target_model_id: str = ""
    vocab_size: int | None = None
    hidden_size: int | None = None
    version: int = SCHEMA_VERSION
    _by_name: dict[str, FieldSpec] = dc_field(default_factory=dict, init=False, repr=False, compare=False)
    _stored: tuple[FieldSpec, ...] = dc_field(default=(), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        fields = tuple(self.fields)
        object.__setattr__(self, "fields", fields)
        names = [f.name for f in fields]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise SchemaError(f"schema: duplicate field names {dup}")
        if not any(f.per_token and f.segment == TOKENS for f in fields):
            raise SchemaError(f"schema: expected at least one per-token field in segment {TOKENS!r}, found {names}")
        if self.version != SCHEMA_VERSION:
            raise SchemaError(f"schema version {self.version}: this code reads version {SCHEMA_VERSION}")
        if any(f.kind == "token_ids" for f in fields) and not (self.vocab_size and self.vocab_size > 0):
            raise SchemaError(f"schema: token-id fields need vocab_size > 0, found {self.vocab_size!r}")
        self._by_name.update({f.name: f for f in fields})
        object.__setattr__(self, "_stored", tuple(s for f in fields for s in f.stored))
        stored = [f.name for f in self._stored]
        taken = sorted({n for n in stored if stored.count(n) > 1})
        if taken:
            raise SchemaError(f"schema: field name(s) {taken} taken by an fp8 field's scales (scale_name); "
                              "rename the field")
        self._check_standard_shapes()

    def _check_standard_shapes(self) -> None:
        h = self.hidden_size
        if "last_hidden" in self._by_name and self.layout.last_hidden == "none":
            raise SchemaError("schema: field 'last_hidden' present but layout.last_hidden is 'none'")
        if h is None:
            return
        expect = {"aux_hidden": (len(self.layout.layer_ids) * h,), "last_hidden": (h,)}
        for name, shape in expect.items():
            f = self._by_name.get(name)
            if f is not None and f.shape != shape:
                raise SchemaError(f"field {name!r}: shape {f.shape}, expected {shape} "
                                  f"(layer_ids={self.layout.layer_ids}, hidden_size={h})")

    def field(self, name: str) -> FieldSpec:
        try:
            return self._by_name[name]
        except KeyError:
            raise SchemaError(f"field {name!r} not in schema; fields: {sorted(self._by_name)}") from None

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(f.name for f in self.fields)

    @property
    def stored_fields(self) -> tuple[FieldSpec, ...]:
        """The tensors a shard holds per field, in field order (``FieldSpec.stored``; the same objects on
        every call, so a raw field is its own stored field)."""
        return self._stored

    @property
    def segments(self) -> tuple[str, ...]:
        """Per-token segments, ``tokens`` first then sorted."""
        segs = {f.segment for f in self.fields if f.per_token}
        return (TOKENS, *sorted(segs - {TOKENS}))

    def to_dict(self) -> dict[str, Any]:
        return {"version": self.version, "fields": [f.to_dict() for f in self.fields],
                "layout": self.layout.to_dict(), "target_model_id": self.target_model_id,
                "vocab_size": self.vocab_size, "hidden_size": self.hidden_size}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Schema:
        try:
            return cls(tuple(FieldSpec.from_dict(f) for f in d["fields"]), Layout.from_dict(d["layout"]),
                       d.get("target_model_id", ""), d.get("vocab_size"), d.get("hidden_size"),
                       d.get("version", SCHEMA_VERSION))
        except (KeyError, TypeError) as e:
            raise SchemaError(f"schema dict: missing or malformed entry {e}") from e

    @property
    def hash(self) -> str:
        canonical = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(canonical.encode()).hexdigest()[:16]

    def diff(self, other: Schema) -> list[str]:
        """Differences, one line per entry, as ``<entry>: self=<a> other=<b>``."""
        out: list[str] = []
        a, b = self.to_dict(), other.to_dict()
        for key in ("version", "layout", "target_model_id", "vocab_size", "hidden_size"):
            if a[key] != b[key]:
                out.append(f"{key}: {a[key]!r} vs {b[key]!r}")
        fa, fb = {f["name"]: f for f in a["fields"]}, {f["name"]: f for f in b["fields"]}
        for name in sorted(fa.keys() | fb.keys()):
            if name not in fb or name not in fa:
                out.append(f"field {name!r}: {'present' if name in fa else 'absent'} vs "
                           f"{'present' if name in fb else 'absent'}")
                continue
            for k in fa[name]:
                if fa[name][k] != fb[name][k]:
                    out.append(f"field {name!r} {k}: {fa[name][k]!r} vs {fb[name][k]!r}")
        if not out and self.names != other.names:
            out.append(f"field order: {list(self.names)} vs {list(other.names)}")
        return out

    def check_fields(self, expected: Iterable[str | FieldSpec]) -> None:
        """Every expected field must exist (and, for a ``FieldSpec``, match dtype/shape/per_token). The
        storage encoding is not compared: a reader gets every field decoded to its ``dtype``."""
        for e in expected:
            name = e if isinstance(e, str) else e.name
            have = self._by_name.get(name)
            if have is None:
                raise SchemaError(f"field {name!r}: expected by the reader, missing from the store "
                                  f"(store fields: {list(self.names)})")
            if isinstance(e, FieldSpec) and replace(e, encoding="raw") != replace(have, encoding="raw"):
                raise SchemaError(f"field {name!r}: store has {have.to_dict()}, expected {e.to_dict()}")


def standard_schema(layout: Layout, *, hidden_size: int, vocab_size: int, target_model_id: str,
                    hidden_dtype: str = "bfloat16", ids_dtype: str = "int64", topk: int | None = None,
                    extra: Sequence[FieldSpec] = (), hidden_encoding: str = "raw") -> Schema:
    """The docs/internals.md fields: input_ids, loss_mask, aux_hidden (unless the layout has no layer
    ids), last_hidden (unless the layout's ``last_hidden`` is ``"none"``), optional target top-k
    ids/logprobs ``[T, topk]``. bf16 by default; ``hidden_encoding="fp8_e4m3"`` stores the two hidden
    fields as e4m3 with a per-token scale (read back as ``hidden_dtype``)."""
    fields = [FieldSpec("input_ids", ids_dtype), FieldSpec("loss_mask", "uint8")]
    if layout.layer_ids:
        fields.append(FieldSpec("aux_hidden", hidden_dtype, (len(layout.layer_ids) * hidden_size,),
                                encoding=hidden_encoding))
    if layout.last_hidden != "none":
        fields.append(FieldSpec("last_hidden", hidden_dtype, (hidden_size,), encoding=hidden_encoding))
    if topk:
        fields += [FieldSpec("target_topk_ids", ids_dtype, (topk,)),
                   FieldSpec("target_topk_logprobs", "float32", (topk,))]
    return Schema(tuple(fields) + tuple(extra), layout, target_model_id, vocab_size, hidden_size)
