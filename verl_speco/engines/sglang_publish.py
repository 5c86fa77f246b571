"""Live draft publishing into SGLang: the `update_weights_from_tensor` request, its checker, a publisher.

Family-generic (names and shapes come from the family's `EngineFormat`), without importing sglang. A
publish is SGLang 0.5.23's draft-only update (`selector="draft"` between `begin_weight_update` and
`end_weight_update`; per TP rank one flattened single-dtype bucket of full tensors). SGLang 0.5.12 has no
draft-only update and is refused (`live_publish_refusal`). SGLang's side: docs/design/engines.md section 4.9."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from drafters.common.contract import EngineFormat
from verl_speco.engines import sglang_engine
from verl_speco.online.publish import stale_reason

LOAD_FORMAT = "flattened_bucket"
DRAFT_SELECTOR = "draft"
REQUEST_FIELDS = ("serialized_named_tensors", "load_format", "flush_cache", "abort_all_requests",
                  "weight_version", "selector")  # what build_draft_update sends
OPTIONAL_FIELDS = ("torch_empty_cache",)  # also accepted by SGLang v0.5.23 (left at its default False)
PAYLOAD_KEYS = ("flattened_tensor", "metadata")
META_FIELDS = ("name", "shape", "dtype", "start_idx", "end_idx", "numel")
DEFAULT_BUCKET_BYTES = 512 << 20
# The SGLang releases whose draft-only weight-update contract (module docstring) was checked against
# their source (tests/deploy/test_sglang_publish_source.py); live publishing refuses any other.
CHECKED_SGLANG = ("0.5.23",)
# What a release CI reads lacks of that contract (each claim asserted against its source by that test).
SGLANG_GAPS: dict[str, str] = {
    "0.5.12": "it has no draft-only weight update: no /begin_weight_update or /end_weight_update route and no "
              "`selector` in UpdateWeightsFromTensorReqInput; its scheduler hands update_weights_from_tensor to "
              "the speculative worker, whose EAGLE workers load the payload into the draft runner AND the target "
              "runner (the target's loader takes the draft's norm.weight and lm_head.weight) and whose DFlash "
              "worker passes it to the target worker alone",
}
Serialize = Callable[[Any], bytes | str]
Deserialize = Callable[[bytes | str], Any]


def live_publish_refusal(version: str) -> str | None:
    """None when SGLang `version` has the draft-only update contract we checked (CHECKED_SGLANG), else why
    live draft publishing into it is refused (its known gap, or "not checked")."""
    from verl_speco.deploy.versions import base_version

    release = base_version(version)
    if release in CHECKED_SGLANG:
        return None
    why = SGLANG_GAPS.get(release, "its weight-update API was not checked against our draft-only publish "
                                   "(re-check with tests/deploy/test_sglang_publish_source.py and add it to "
                                   "CHECKED_SGLANG)")
    return (f"SGLang {version}: live draft publishing needs SGLang {', '.join(CHECKED_SGLANG)}: {why}. Install "
            f"sglang=={CHECKED_SGLANG[-1]}, use rollout.name=vllm, or train offline (the `separate` workflow)")


class SGLangPublishError(ValueError):
    """A draft update SGLang would reject or load wrongly, or a publish the client refused."""


@dataclass(frozen=True)
class FlatTensorMeta:
    """Field-for-field mirror of SGLang's `FlattenedTensorMetadata` (used when sglang is absent)."""

    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


@dataclass(frozen=True, eq=False)  # holds tensors: identity, not elementwise, equality
class Bucket:
    """One flattened bucket: a 1-D tensor of a single dtype and the metadata of its tensors."""

    flattened_tensor: Tensor
    metadata: tuple[Any, ...]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(m.name for m in self.metadata)

    def payload(self) -> dict[str, Any]:
        """What one TP rank's `serialized_named_tensors` entry deserializes to."""
        return {"flattened_tensor": self.flattened_tensor, "metadata": list(self.metadata)}


def metadata_class() -> type:
    """SGLang's `FlattenedTensorMetadata` when importable (its restricted unpickler accepts it), else ours."""
    return sglang_engine.flattened_tensor_metadata_class() or FlatTensorMeta


def sglang_serializer() -> Serialize | None:
    """SGLang's `MultiprocessingSerializer.serialize` (see `sglang_engine.serializer`); None without sglang."""
    return sglang_engine.serializer()


def sglang_deserializer() -> Deserialize | None:
    """SGLang's `MultiprocessingSerializer.deserialize`; None without sglang."""
    return sglang_engine.deserializer()


def _expected(fmt: EngineFormat) -> dict[str, tuple[int, ...]]:
    try:
        return fmt.sglang_expected_shapes()
    except ValueError as e:
        raise SGLangPublishError(str(e)) from None


def publishable_tensors(engine_tensors: Mapping[str, Tensor], fmt: EngineFormat) -> dict[str, Tensor]:
    """The draft tensors SGLang's draft runner receives, in its names and order, validated: `engine_tensors`
    minus what `fmt.sglang_never_published()` names, on their device (CUDA goes as IPC handles)."""
    want = _expected(fmt)
    never = fmt.sglang_never_published()
    got = {k: v for k, v in engine_tensors.items() if k not in never}
    missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
    if missing or extra:
        raise SGLangPublishError(f"draft state dict: missing {missing}, unexpected {extra} "
                                 f"(SGLang's {fmt.family} draft takes exactly {sorted(want)})")
    out: dict[str, Tensor] = {}
    for name, shape in want.items():
        t = got[name].detach()
        if tuple(t.shape) != shape:
            raise SGLangPublishError(f"{name}: shape {tuple(t.shape)}, expected {shape}")
        if not t.is_floating_point():
            raise SGLangPublishError(f"{name}: dtype {t.dtype}, expected a floating dtype")
        out[name] = t
    return out


def build_buckets(tensors: Mapping[str, Tensor], bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> list[Bucket]:
    """Flattened buckets grouped by dtype, each at most `bucket_bytes` (a larger tensor gets its own);
    indices count elements of the bucket's dtype, so both of SGLang's readers return views."""
    if bucket_bytes < 1:
        raise SGLangPublishError(f"bucket_bytes: got {bucket_bytes}, expected >= 1")
    if not tensors:
        raise SGLangPublishError("tensors: empty; SGLang's FlattenedTensorBucket cannot be empty")
    meta_cls = metadata_class()
    by_dtype: dict[torch.dtype, list[tuple[str, Tensor]]] = {}
    for name, t in tensors.items():
        by_dtype.setdefault(t.dtype, []).append((name, t))
    groups: list[list[tuple[str, Tensor]]] = []
    for items in by_dtype.values():
        current: list[tuple[str, Tensor]] = []
        size = 0
        for name, t in items:
            nbytes = t.numel() * t.element_size()
            if current and size + nbytes > bucket_bytes:
                groups.append(current)
                current, size = [], 0
            current.append((name, t))
            size += nbytes
        groups.append(current)
    buckets = []
    for group in groups:
        metadata, start = [], 0
        for name, t in group:
            n = t.numel()
            metadata.append(meta_cls(name=name, shape=t.shape, dtype=t.dtype, start_idx=start, end_idx=start + n,
                                     numel=n))
            start += n
        flat = torch.cat([t.reshape(-1) for _, t in group])  # a copy: later training steps do not alter it
        buckets.append(Bucket(flat, tuple(metadata)))
    return buckets


@dataclass(frozen=True, eq=False)
class SGLangDraftUpdate:
    """One draft version, bucketed and ready to be turned into `update_weights_from_tensor` requests."""

    version: int
    buckets: tuple[Bucket, ...]
    tp_size: int
    flush_cache: bool = True
    abort_all_requests: bool = False
    weight_version: str | None = None

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(n for b in self.buckets for n in b.names)

    def requests(self, serialize: Serialize | None = None) -> list[dict[str, Any]]:
        """The exact kwargs of each `update_weights_from_tensor` call, in order (one bucket each), every
        rank's entry serialized afresh (no reused IPC handles); only the last flushes the cache and only
        the first aborts requests, all with the same `weight_version`."""
        ser = serialize or sglang_serializer()
        if ser is None:
            raise SGLangPublishError("serialize: sglang is not importable here; pass serialize= (SGLang's "
                                     "MultiprocessingSerializer.serialize in its own process)")
        last = len(self.buckets) - 1
        return [{
            "serialized_named_tensors": [ser(bucket.payload()) for _ in range(self.tp_size)],
            "load_format": LOAD_FORMAT,
            "flush_cache": self.flush_cache and i == last,
            "abort_all_requests": self.abort_all_requests and i == 0,
            "weight_version": self.weight_version,
            "selector": DRAFT_SELECTOR,
        } for i, bucket in enumerate(self.buckets)]


def build_draft_update(state_dict: Mapping[str, Tensor], fmt: EngineFormat, *, version: int,
                       tp_size: int = 1, bucket_bytes: int = DEFAULT_BUCKET_BYTES, flush_cache: bool = True,
                       abort_all_requests: bool = False, weight_version: str | None = None) -> SGLangDraftUpdate:
    """Validate and bucket a draft's engine tensors (`fmt`'s native names) for SGLang's draft runner."""
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise SGLangPublishError(f"version: got {version!r}, expected an integer >= 0")
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise SGLangPublishError(f"tp_size: got {tp_size!r}, expected an integer >= 1 (SGLang's TP world size)")
    if weight_version is not None and not isinstance(weight_version, str):
        raise SGLangPublishError(f"weight_version: got {weight_version!r}, expected a str or None")
    buckets = build_buckets(publishable_tensors(state_dict, fmt), bucket_bytes)
    return SGLangDraftUpdate(version, tuple(buckets), tp_size, flush_cache, abort_all_requests, weight_version)


def _bits(t: Tensor) -> Tensor:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def _check_fields(i: int, req: Mapping[str, Any], tp_size: int) -> list[str]:
    where, problems = f"request[{i}]", []
    unknown = sorted(set(req) - set(REQUEST_FIELDS) - set(OPTIONAL_FIELDS))
    missing = [k for k in ("serialized_named_tensors", "load_format", "selector") if k not in req]
    if unknown:
        problems.append(f"{where}: unknown fields {unknown}; UpdateWeightsFromTensorReqInput has "
                        f"{list(REQUEST_FIELDS + OPTIONAL_FIELDS)}")
    if missing:
        problems.append(f"{where}: missing fields {missing}")
    if req.get("load_format", LOAD_FORMAT) != LOAD_FORMAT:
        problems.append(f"{where}.load_format: got {req.get('load_format')!r}, expected {LOAD_FORMAT!r} (payloads "
                        "are flattened buckets)")
    if req.get("selector", DRAFT_SELECTOR) != DRAFT_SELECTOR:
        problems.append(f"{where}.selector: got {req.get('selector')!r}, expected {DRAFT_SELECTOR!r} (any other "
                        "runner would load draft names into the target: norm.weight, lm_head.weight)")
    for key in ("flush_cache", "abort_all_requests", "torch_empty_cache"):
        if key in req and not isinstance(req[key], bool):
            problems.append(f"{where}.{key}: got {req[key]!r}, expected a bool")
    if req.get("weight_version") is not None and not isinstance(req["weight_version"], str):
        problems.append(f"{where}.weight_version: got {req['weight_version']!r}, expected a str or None")
    entries = req.get("serialized_named_tensors", [])
    if not isinstance(entries, list) or len(entries) != tp_size:
        n = len(entries) if isinstance(entries, list) else type(entries).__name__
        problems.append(f"{where}.serialized_named_tensors: got {n} entries, expected a list of {tp_size} "
                        "(one per TP rank; rank r reads entry r)")
    elif any(not isinstance(e, bytes | str) for e in entries):
        problems.append(f"{where}.serialized_named_tensors: entries of type "
                        f"{sorted({type(e).__name__ for e in entries})}, expected bytes (or base64 str)")
    return problems


def _check_bucket(where: str, payload: Any) -> tuple[list[str], list[tuple[Any, Tensor]]]:
    """Problems of one deserialized bucket, and (metadata, reconstructed tensor) pairs when sound."""
    if not isinstance(payload, Mapping) or sorted(payload) != sorted(PAYLOAD_KEYS):
        keys = sorted(payload) if isinstance(payload, Mapping) else type(payload).__name__
        return [f"{where}: got {keys}, expected a dict with keys {list(PAYLOAD_KEYS)}"], []
    flat, metadata = payload["flattened_tensor"], payload["metadata"]
    if not isinstance(flat, Tensor) or flat.dim() != 1:
        shape = tuple(flat.shape) if isinstance(flat, Tensor) else type(flat).__name__
        return [f"{where}.flattened_tensor: got {shape}, expected a 1-D tensor"], []
    if not isinstance(metadata, list | tuple) or not metadata:
        return [f"{where}.metadata: got {metadata!r}, expected a non-empty list of FlattenedTensorMetadata"], []
    problems: list[str] = []
    out: list[tuple[Any, Tensor]] = []
    expect_start = 0
    for j, m in enumerate(metadata):
        at = f"{where}.metadata[{j}]"
        lacking = [f for f in META_FIELDS if not hasattr(m, f)]
        if lacking:
            problems.append(f"{at}: lacks {lacking} (SGLang reads {list(META_FIELDS)})")
            continue
        at, numel, mine = f"{at} ({m.name})", math.prod(tuple(m.shape)), []
        if m.start_idx != expect_start:
            mine.append(f"{at}.start_idx: got {m.start_idx}, expected {expect_start} (contiguous, in order)")
        if not m.end_idx - m.start_idx == m.numel == numel:
            mine.append(f"{at}: end_idx - start_idx = {m.end_idx - m.start_idx}, numel = {m.numel}, "
                        f"prod(shape {tuple(m.shape)}) = {numel}; expected all equal (element indices)")
        if m.end_idx > flat.numel():
            mine.append(f"{at}.end_idx: {m.end_idx} beyond the {flat.numel()}-element flattened_tensor")
        if m.dtype != flat.dtype:
            mine.append(f"{at}.dtype: {m.dtype} in a {flat.dtype} bucket; expected the bucket's dtype (older "
                        "SGLang converts values with .to(), newer reinterprets bytes with .view(): not bit-exact)")
        expect_start = m.end_idx
        problems += mine
        if not mine:
            out.append((m, flat[m.start_idx:m.end_idx].view(m.dtype).reshape(tuple(m.shape))))
    if not problems and expect_start != flat.numel():
        problems.append(f"{where}.flattened_tensor: {flat.numel()} elements, metadata covers {expect_start}")
    return problems, out


def check_draft_update(requests: Sequence[Mapping[str, Any]], fmt: EngineFormat, *, tp_size: int,
                       deserialize: Deserialize | None = None,
                       expected: Mapping[str, Tensor] | None = None) -> dict[str, Tensor]:
    """Validate requests against SGLang's request and draft-loader contract for format `fmt` (fields, one
    identical entry per TP rank, bucket metadata, names and shapes, dtypes, with `expected` bit-exact values);
    returns the tensors rank 0 loads; SGLangPublishError lists every problem."""
    des = deserialize or sglang_deserializer()
    if des is None:
        raise SGLangPublishError("deserialize: sglang is not importable here; pass deserialize=")
    problems: list[str] = [] if requests else ["requests: empty, expected one request per bucket"]
    want = _expected(fmt)
    never = fmt.sglang_never_published()
    loaded: dict[str, Tensor] = {}
    for i, req in enumerate(requests):
        field_problems = _check_fields(i, req, tp_size)
        problems += field_problems
        if field_problems:
            continue
        per_rank = []
        for r, entry in enumerate(req["serialized_named_tensors"]):
            bucket_problems, pairs = _check_bucket(f"request[{i}].serialized_named_tensors[{r}]", des(entry))
            problems += bucket_problems
            per_rank.append(pairs)
        if any(not pairs for pairs in per_rank):
            continue
        for r, pairs in enumerate(per_rank[1:], start=1):
            if [m.name for m, _ in pairs] != [m.name for m, _ in per_rank[0]] or any(
                    not torch.equal(_bits(a), _bits(b)) for (_, a), (_, b) in zip(pairs, per_rank[0], strict=True)):
                problems.append(f"request[{i}].serialized_named_tensors[{r}]: differs from rank 0 (every rank "
                                "receives the full tensors; SGLang's loaders shard them)")
        for m, t in per_rank[0]:
            if m.name in loaded:
                problems.append(f"{m.name}: sent twice (request[{i}] again)")
            loaded[m.name] = t
    if problems:
        raise SGLangPublishError("SGLang draft update rejected:\n  - " + "\n  - ".join(problems))
    for name, t in loaded.items():
        if name in never:
            problems.append(f"{name}: must not be published ({never[name]})")
        elif name not in want:
            problems.append(f"{name}: not a parameter of SGLang's {fmt.family} draft; its loader would drop it "
                            "silently")
        elif tuple(t.shape) != want[name]:
            problems.append(f"{name}: shape {tuple(t.shape)}, expected {want[name]}")
        elif not t.is_floating_point():
            problems.append(f"{name}: dtype {t.dtype}, expected a floating dtype")
    problems += [f"{name}: missing (expected shape {shape})" for name, shape in want.items() if name not in loaded]
    for name, ref in (expected or {}).items():
        got = loaded.get(name)
        if got is not None and (got.dtype != ref.dtype or tuple(got.shape) != tuple(ref.shape)
                                or not torch.equal(_bits(got), _bits(ref))):
            problems.append(f"{name}: reconstructed tensor differs from the source ({got.dtype} vs {ref.dtype}); "
                            "expected a bit-exact copy")
    if problems:
        raise SGLangPublishError("SGLang draft update rejected:\n  - " + "\n  - ".join(problems))
    return loaded


class SGLangClient(Protocol):
    """What the publisher calls, with SGLang's request field names: SGLang's HTTP API or an in-process
    adapter over `TokenizerManager.update_weights_from_tensor`. `sglang.Engine` itself cannot be one: its
    `update_weights_from_tensor` cannot carry `selector` (it sends "all")."""

    def update_weights_from_tensor(self, **request: Any) -> Any: ...


def _reply(result: Any) -> tuple[bool, str]:
    """(success, message) from SGLang's replies: a (success, message) tuple, a dict or an *ReqOutput object."""
    if isinstance(result, tuple | list) and result and isinstance(result[0], bool):
        return result[0], str(result[1]) if len(result) > 1 else ""
    if isinstance(result, Mapping) and isinstance(result.get("success"), bool):
        return bool(result["success"]), str(result.get("message", ""))
    if isinstance(getattr(result, "success", None), bool):
        return bool(result.success), str(getattr(result, "message", ""))
    raise SGLangPublishError(f"client reply: got {result!r}, expected (success, message), a dict with 'success' "
                             "or an object with .success")


class SGLangDraftPublisher:
    """Publishes draft versions to one SGLang server with the versioning of our vLLM path: versions only
    move forward, the latest applied is kept as a bucketed snapshot for `reapply()` after the target's
    weight sync or resume, and a refused apply leaves `latest` unchanged. `weight_version_tag` defaults to
    None so the target policy's label is not overwritten."""

    def __init__(self, client: SGLangClient, cfg: EngineFormat, *, tp_size: int = 1,
                 serialize: Serialize | None = None, bucket_bytes: int = DEFAULT_BUCKET_BYTES, session: bool = True,
                 weight_version_tag: Callable[[int], str] | None = None) -> None:
        for method in ("update_weights_from_tensor",) + (("begin_weight_update", "end_weight_update") if session else ()):
            if not callable(getattr(client, method, None)):
                raise SGLangPublishError(f"client: has no {method}() (got {type(client).__name__})")
        self.client, self.cfg, self.tp_size = client, cfg, tp_size
        self.serialize, self.bucket_bytes, self.session = serialize, bucket_bytes, session
        self.weight_version_tag = weight_version_tag
        self.latest: SGLangDraftUpdate | None = None
        self.applied_version: int | None = None
        self.dropped = 0

    @property
    def latest_version(self) -> int | None:
        return None if self.latest is None else self.latest.version

    def publish(self, state_dict: Mapping[str, Tensor], version: int) -> bool:
        """Apply `version` unless it is not newer than the latest applied one; True when applied."""
        if stale_reason(version, self.latest_version) is not None:
            self.dropped += 1
            return False
        tag = self.weight_version_tag(version) if self.weight_version_tag is not None else None
        update = build_draft_update(state_dict, self.cfg, version=version, tp_size=self.tp_size,
                                    bucket_bytes=self.bucket_bytes, weight_version=tag)
        self._apply(update)
        self.latest = update
        return True

    def reapply(self) -> int:
        """Send the latest applied version again (same tensors); its version, -1 before the first publish."""
        if self.latest is None:
            return -1
        self._apply(self.latest)
        return self.latest.version

    def on_resume(self, tags: Iterable[str] | None = None) -> int:
        """After `resume_memory_occupation(tags)`: `reapply()` when the weights came back (tags None/empty or
        containing "weights"); -1 when nothing was re-applied."""
        tag_list = list(tags or [])
        if tag_list and "weights" not in tag_list:
            return -1
        return self.reapply()

    def _apply(self, update: SGLangDraftUpdate) -> None:
        self.applied_version = None  # unknown until every bucket landed
        requests = update.requests(self.serialize)
        if self.session:
            self._call("begin_weight_update", selector=DRAFT_SELECTOR)
        try:
            for i, request in enumerate(requests):
                self._call("update_weights_from_tensor", what=f"bucket {i + 1}/{len(requests)}", **request)
        finally:
            if self.session:
                self._call("end_weight_update")
        self.applied_version = update.version

    def _call(self, method: str, what: str = "", **kwargs: Any) -> None:
        result = getattr(self.client, method)(**kwargs)
        if method == "update_weights_from_tensor" or result is not None:
            ok, message = _reply(result)
            if not ok:
                raise SGLangPublishError(f"{method}{f' ({what})' if what else ''}: SGLang refused: {message} "
                                         f"(latest applied draft version: {self.latest_version}, see reapply())")
