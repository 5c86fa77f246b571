"""SGLang live draft publishing: exact request, bit-exact bucket round trip, named defects, versioning.

The draft is a real `drafters.eagle3` model built on the tiny Qwen3 target of this directory's
conftest. SGLang's serializer is replaced by an opaque-handle store (bytes handles, no pickling):
the payload objects stay in-process, exactly as SGLang's reader would get them back.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from drafters.common.contract import StoreStats
from drafters.common.target import TargetHead
from drafters.eagle3 import FAMILY, Eagle3Config
from drafters.eagle3.export import Eagle3ExportConfig, export_eagle3, native_config
from drafters.eagle3.sglang import NEVER_PUBLISHED, check_sglang_eagle3_export, sglang_expected_tensors
from verl_speco.engines.sglang_publish import (
    DRAFT_SELECTOR,
    LOAD_FORMAT,
    REQUEST_FIELDS,
    FlatTensorMeta,
    SGLangDraftPublisher,
    SGLangPublishError,
    build_buckets,
    build_draft_update,
    check_draft_update,
    publishable_tensors,
)

from .conftest import AUX_IDS, LAYERS, VOCAB

DRAFT_VOCAB = 48
MATRICES = ("fc.weight", "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight",
            "midlayer.self_attn.v_proj.weight", "midlayer.self_attn.o_proj.weight", "midlayer.mlp.gate_proj.weight",
            "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight", "lm_head.weight")
NORMS = ("midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
         "midlayer.post_attention_layernorm.weight", "norm.weight")


class HandleStore:
    """Stand-in for SGLang's MultiprocessingSerializer: opaque bytes handles, payloads kept in-process."""

    def __init__(self) -> None:
        self.payloads: dict[bytes, Any] = {}

    def serialize(self, obj: Any) -> bytes:
        handle = f"payload-{len(self.payloads)}".encode()
        self.payloads[handle] = obj
        return handle

    def deserialize(self, data: bytes | str) -> Any:
        return self.payloads[data.encode() if isinstance(data, str) else data]


class RecordingClient:
    """Records every call like SGLang's HTTP endpoints would receive it; replies (success, message)."""

    def __init__(self, fail_on_call: int | None = None) -> None:
        self.calls: list[tuple[str, dict[str, Any]]] = []
        self.fail_on_call = fail_on_call

    def begin_weight_update(self, **kw: Any) -> dict[str, Any]:
        self.calls.append(("begin_weight_update", kw))
        return {"success": True, "message": "ok"}

    def end_weight_update(self, **kw: Any) -> dict[str, Any]:
        self.calls.append(("end_weight_update", kw))
        return {"success": True, "message": "ok"}

    def update_weights_from_tensor(self, **request: Any) -> tuple[bool, str]:
        self.calls.append(("update_weights_from_tensor", request))
        if self.fail_on_call is not None and len(self.calls) == self.fail_on_call:
            return False, "CUDA out of memory"
        return True, "Success"

    def updates(self) -> list[dict[str, Any]]:
        return [kw for name, kw in self.calls if name == "update_weights_from_tensor"]


@pytest.fixture(scope="module")
def draft(target_dir: Path) -> tuple[torch.nn.Module, Eagle3ExportConfig]:
    head = TargetHead.from_pretrained(target_dir)
    counts = torch.randint(0, 1000, (VOCAB,), generator=torch.Generator().manual_seed(3))
    cfg = Eagle3Config(draft_vocab_size=DRAFT_VOCAB, aux_layer_ids=AUX_IDS, attn_backend="sdpa")
    torch.manual_seed(0)
    model = FAMILY.build(cfg, head, StoreStats(counts))
    return model, Eagle3ExportConfig.from_drafter(cfg, head.spec)


def mixed_precision(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """bf16 matrices, fp32 norms (as a bf16 rollout with fp32 norms would hold them), plus the unpublished rest."""
    sd = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {k: v.to(torch.bfloat16) if k in MATRICES else v for k, v in sd.items()}


def test_request_is_exactly_sglangs_draft_update(draft: tuple[torch.nn.Module, Eagle3ExportConfig]) -> None:
    model, cfg = draft
    store = HandleStore()
    update = build_draft_update(mixed_precision(model), cfg, version=4, tp_size=2, bucket_bytes=64 << 10)
    requests = update.requests(store.serialize)
    # dtype groups in first-appearance order (fc is bf16), bf16 split at 64 KiB, norms in one fp32 bucket
    assert [b.flattened_tensor.dtype for b in update.buckets] == [torch.bfloat16] * 3 + [torch.float32]
    assert [b.names for b in update.buckets] == [
        ("fc.weight", "midlayer.self_attn.q_proj.weight"),
        ("midlayer.self_attn.k_proj.weight", "midlayer.self_attn.v_proj.weight", "midlayer.self_attn.o_proj.weight",
         "midlayer.mlp.gate_proj.weight"),
        ("midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight", "lm_head.weight"),
        ("midlayer.input_layernorm.weight", "midlayer.hidden_norm.weight",
         "midlayer.post_attention_layernorm.weight", "norm.weight")]
    assert [b.flattened_tensor.numel() for b in update.buckets] == [12288 + 16384, 8192 * 4, 8192 * 2 + 48 * 64, 256]
    assert len(requests) == 4 and all(tuple(r) == REQUEST_FIELDS for r in requests)
    assert [r["flush_cache"] for r in requests] == [False, False, False, True]  # flush once, after the last bucket
    assert all(r["load_format"] == LOAD_FORMAT == "flattened_bucket" for r in requests)
    assert all(r["selector"] == DRAFT_SELECTOR == "draft" for r in requests)
    assert all(r["abort_all_requests"] is False and r["weight_version"] is None for r in requests)
    # one entry per TP rank, serialized separately (each rank reads its own copy), each a full bucket
    assert [r["serialized_named_tensors"] for r in requests[:2]] == [[b"payload-0", b"payload-1"],
                                                                    [b"payload-2", b"payload-3"]]
    payload = store.deserialize(requests[3]["serialized_named_tensors"][1])
    assert sorted(payload) == ["flattened_tensor", "metadata"]
    assert [(m.name, tuple(m.shape), m.dtype, m.start_idx, m.end_idx, m.numel) for m in payload["metadata"]] == [
        ("midlayer.input_layernorm.weight", (64,), torch.float32, 0, 64, 64),
        ("midlayer.hidden_norm.weight", (64,), torch.float32, 64, 128, 64),
        ("midlayer.post_attention_layernorm.weight", (64,), torch.float32, 128, 192, 64),
        ("norm.weight", (64,), torch.float32, 192, 256, 64)]
    assert all(type(m) is FlatTensorMeta for m in payload["metadata"])  # sglang absent: the field-for-field mirror


def _sglang_old_reader(payload: dict[str, Any]) -> dict[str, torch.Tensor]:
    """SGLang's pre-`supports_multi_dtypes` FlattenedTensorBucket.reconstruct_tensors."""
    out = {}
    for m in payload["metadata"]:
        t = payload["flattened_tensor"][m.start_idx:m.end_idx].reshape(m.shape)
        out[m.name] = t.to(m.dtype) if t.dtype != m.dtype else t
    return out


def _sglang_new_reader(payload: dict[str, Any]) -> dict[str, torch.Tensor]:
    """SGLang's `supports_multi_dtypes = True` reconstruct_tensors (slice, view as dtype, reshape)."""
    return {m.name: payload["flattened_tensor"][m.start_idx:m.end_idx].view(m.dtype).reshape(m.shape)
            for m in payload["metadata"]}


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8),
                                                                    b.reshape(-1).view(torch.uint8))


@pytest.mark.parametrize("tp_size", [1, 4])
def test_every_tensor_round_trips_bit_exactly(draft: tuple[torch.nn.Module, Eagle3ExportConfig], tp_size: int) -> None:
    model, cfg = draft
    store, sd = HandleStore(), mixed_precision(model)
    sd["norm.weight"][7] = float("nan")  # bit-exact means bit-exact: NaN payloads survive too
    sd["midlayer.hidden_norm.weight"][0] = -0.0
    requests = build_draft_update(sd, cfg, version=1, tp_size=tp_size, bucket_bytes=40 << 10).requests(store.serialize)
    expected = sglang_expected_tensors(native_config(cfg))  # SGLang's loader facts, from its config.json
    loaded = check_draft_update(requests, cfg, tp_size=tp_size, deserialize=store.deserialize, expected=sd)
    assert sorted(loaded) == sorted(expected)  # SGLang names, all of them
    assert {k: tuple(v.shape) for k, v in loaded.items()} == expected
    assert expected["fc.weight"] == (64, 192) and expected["lm_head.weight"] == (DRAFT_VOCAB, 64)
    for request in requests:
        for entry in request["serialized_named_tensors"]:
            payload = store.deserialize(entry)
            for reader in (_sglang_old_reader, _sglang_new_reader):
                for name, t in reader(payload).items():
                    assert _same_bits(t, sd[name]), (reader.__name__, name)
    assert not set(NEVER_PUBLISHED) & set(loaded)  # d2t, t2d and the shared embedding stay home
    assert torch.isnan(loaded["norm.weight"][7]) and torch.signbit(loaded["midlayer.hidden_norm.weight"][0])


def test_mixed_dtype_bucket_would_not_be_bit_exact() -> None:
    """Why buckets are dtype-grouped: SGLang's older reader value-converts, and bf16 cannot hold an int64 id."""
    ids = torch.tensor([151643], dtype=torch.int64)
    flat = torch.cat([torch.zeros(2, dtype=torch.bfloat16), ids.to(torch.bfloat16)])  # what torch.cat promotes to
    meta = [FlatTensorMeta("w", torch.Size([2]), torch.bfloat16, 0, 2, 2), FlatTensorMeta("d2t", ids.shape, ids.dtype, 2, 3, 1)]
    assert int(_sglang_old_reader({"flattened_tensor": flat, "metadata": meta})["d2t"]) == 151552 != 151643
    buckets = build_buckets({"w": torch.zeros(2, dtype=torch.bfloat16), "d2t": ids})
    assert [(b.flattened_tensor.dtype, b.names) for b in buckets] == [(torch.bfloat16, ("w",)), (torch.int64, ("d2t",))]
    assert int(_sglang_old_reader(buckets[1].payload())["d2t"]) == 151643


@pytest.mark.parametrize(("edit", "message"), [
    (lambda sd: sd.pop("norm.weight"), r"missing \['norm.weight'\]"),
    (lambda sd: sd.update({"layers.1.mlp.up_proj.weight": torch.zeros(128, 64)}),
     r"unexpected \['layers.1.mlp.up_proj.weight'\]"),
    (lambda sd: sd.update({"fc.weight": torch.zeros(64, 128)}), r"fc.weight: shape \(64, 128\), expected \(64, 192\)"),
    (lambda sd: sd.update({"lm_head.weight": torch.zeros(VOCAB, 64)}),
     r"lm_head.weight: shape \(96, 64\), expected \(48, 64\)"),
    (lambda sd: sd.update({"norm.weight": torch.ones(64, dtype=torch.int32)}),
     r"norm.weight: dtype torch.int32, expected a floating dtype"),
])
def test_bad_state_dicts_are_named(draft: tuple[torch.nn.Module, Eagle3ExportConfig],
                                   edit: Callable[[dict[str, torch.Tensor]], object], message: str) -> None:
    model, cfg = draft
    sd = mixed_precision(model)
    edit(sd)
    with pytest.raises(SGLangPublishError, match=message):
        build_draft_update(sd, cfg, version=0)


def test_bad_arguments_are_named(draft: tuple[torch.nn.Module, Eagle3ExportConfig]) -> None:
    model, cfg = draft
    sd = mixed_precision(model)
    with pytest.raises(SGLangPublishError, match=r"tp_size: got 0, expected an integer >= 1"):
        build_draft_update(sd, cfg, version=0, tp_size=0)
    with pytest.raises(SGLangPublishError, match=r"version: got -1"):
        build_draft_update(sd, cfg, version=-1)
    with pytest.raises(SGLangPublishError, match=r"weight_version: got 3, expected a str or None"):
        build_draft_update(sd, cfg, version=0, weight_version=3)  # type: ignore[arg-type]
    with pytest.raises(SGLangPublishError, match=r"num_layers: got 2, expected 1 .*additional_layers"):
        publishable_tensors(sd, replace(cfg, num_layers=2))
    # SGLang's midlayer always keeps the raw hidden as the residual: another function, refused (not only in tests)
    with pytest.raises(SGLangPublishError, match=r"norm_before_residual: got True, expected False"):
        build_draft_update(sd, replace(cfg, norm_before_residual=True), version=0)
    with pytest.raises(SGLangPublishError, match=r"serialize: sglang is not importable here"):
        build_draft_update(sd, cfg, version=0).requests()
    requests = build_draft_update(sd, cfg, version=0).requests(HandleStore().serialize)
    with pytest.raises(SGLangPublishError, match=r"deserialize: sglang is not importable here"):
        check_draft_update(requests, cfg, tp_size=1)


def _edit_payload(key: str, fn: Callable[[Any], Any]) -> Callable[[list[dict[str, Any]], HandleStore], None]:
    def edit(requests: list[dict[str, Any]], store: HandleStore) -> None:  # the same edit on every rank's copy
        for handle in requests[0]["serialized_named_tensors"]:
            store.payloads[handle] = {**store.payloads[handle], key: fn(store.payloads[handle][key])}
    return edit


def _shift(meta: list[Any]) -> list[Any]:
    m = meta[1]
    return [meta[0], FlatTensorMeta(m.name, m.shape, m.dtype, m.start_idx + 1, m.end_idx + 1, m.numel), *meta[2:]]


def _rename(meta: list[Any], name: str) -> list[Any]:
    m = meta[0]
    return [FlatTensorMeta(name, m.shape, m.dtype, m.start_idx, m.end_idx, m.numel), *meta[1:]]


@pytest.mark.parametrize(("edit", "message"), [
    (lambda rs, _: rs[0].update(load_format=None), r"request\[0\].load_format: got None, expected 'flattened_bucket'"),
    (lambda rs, _: rs[1].update(selector="all"), r"request\[1\].selector: got 'all', expected 'draft' .*norm.weight"),
    (lambda rs, _: rs[0].update(disable_draft_model=False), r"request\[0\]: unknown fields \['disable_draft_model'\]"),
    (lambda rs, _: rs[0].update(flush_cache="yes"), r"request\[0\].flush_cache: got 'yes', expected a bool"),
    (lambda rs, _: rs[0].update(torch_empty_cache=1), r"request\[0\].torch_empty_cache: got 1, expected a bool"),
    (lambda rs, _: rs[0]["serialized_named_tensors"].pop(), r"got 1 entries, expected a list of 2 .*rank r reads entry r"),
    (lambda rs, _: rs[0].update(serialized_named_tensors=[{}, {}]), r"entries of type \['dict'\], expected bytes"),
    (_edit_payload("metadata", _shift), r"metadata\[1\] \(midlayer.self_attn.q_proj.weight\).start_idx: got 12289, "
                                        r"expected 12288"),
    (_edit_payload("flattened_tensor", lambda t: t.float()),
     r"metadata\[0\] \(fc.weight\).dtype: torch.bfloat16 in a torch.float32 bucket"),
    (_edit_payload("flattened_tensor", lambda t: t[:-1]),
     r"\(midlayer.self_attn.q_proj.weight\).end_idx: 28672 beyond the 28671-element flattened_tensor"),
    (_edit_payload("metadata", lambda m: _rename(m, "embed_tokens.weight")),
     r"embed_tokens.weight: must not be published .*overwrite the target"),
    (_edit_payload("metadata", lambda m: _rename(m, "layers.0.fc.weight")),
     r"layers.0.fc.weight: not a parameter of SGLang's eagle3 draft.*silently"),
    (lambda rs, _: rs.pop(), r"norm.weight: missing \(expected shape \(64,\)\)"),
])
def test_bad_requests_are_named(draft: tuple[torch.nn.Module, Eagle3ExportConfig],
                                edit: Callable[[list[dict[str, Any]], HandleStore], object], message: str) -> None:
    model, cfg = draft
    store, sd = HandleStore(), mixed_precision(model)
    requests = build_draft_update(sd, cfg, version=0, tp_size=2, bucket_bytes=64 << 10).requests(store.serialize)
    check_draft_update(requests, cfg, tp_size=2, deserialize=store.deserialize, expected=sd)
    requests[-1]["torch_empty_cache"] = True  # a real field of SGLang's request we leave at its default: accepted
    check_draft_update(requests, cfg, tp_size=2, deserialize=store.deserialize, expected=sd)
    edit(requests, store)
    with pytest.raises(SGLangPublishError, match=message):
        check_draft_update(requests, cfg, tp_size=2, deserialize=store.deserialize)


def test_ranks_must_carry_the_same_bucket(draft: tuple[torch.nn.Module, Eagle3ExportConfig]) -> None:
    model, cfg = draft
    store = HandleStore()
    requests = build_draft_update(mixed_precision(model), cfg, version=0, tp_size=3).requests(store.serialize)
    handle = requests[0]["serialized_named_tensors"][2]
    store.payloads[handle] = {**store.payloads[handle], "flattened_tensor": store.payloads[handle]["flattened_tensor"] * 2}
    with pytest.raises(SGLangPublishError, match=r"request\[0\].serialized_named_tensors\[2\]: differs from rank 0"):
        check_draft_update(requests, cfg, tp_size=3, deserialize=store.deserialize)
    store.payloads[handle] = ["not", "a", "bucket"]
    with pytest.raises(SGLangPublishError, match=r"serialized_named_tensors\[2\]: got list, expected a dict with keys "
                                                 r"\['flattened_tensor', 'metadata'\]"):
        check_draft_update(requests, cfg, tp_size=3, deserialize=store.deserialize)


def test_live_names_are_the_exported_checkpoint_names(draft: tuple[torch.nn.Module, Eagle3ExportConfig],
                                                      tmp_path: Path) -> None:
    """What a live publish loads is what SGLang loads from our export at launch, minus the launch-only vocab map."""
    model, cfg = draft
    out = export_eagle3(model.state_dict(), cfg, tmp_path / "native")
    check_sglang_eagle3_export(out, expected_aux_layer_ids=AUX_IDS, target_num_hidden_layers=LAYERS)
    with safe_open(str(out / "model.safetensors"), framework="pt") as f:
        exported = {k: f.get_tensor(k) for k in f.keys()}
    store = HandleStore()
    requests = build_draft_update(model.state_dict(), cfg, version=0).requests(store.serialize)
    assert sglang_expected_tensors(json.loads((out / "config.json").read_text())) == cfg.sglang_expected_shapes()
    loaded = check_draft_update(requests, cfg, tp_size=1,
                                deserialize=store.deserialize, expected=exported)
    assert sorted(exported) == sorted([*loaded, "d2t", "t2d"])
    assert all(_same_bits(loaded[k], exported[k]) for k in loaded)


def test_tampered_bits_fail_the_source_comparison(draft: tuple[torch.nn.Module, Eagle3ExportConfig]) -> None:
    model, cfg = draft
    store, sd = HandleStore(), mixed_precision(model)
    requests = build_draft_update(sd, cfg, version=0).requests(store.serialize)
    store.payloads[requests[-1]["serialized_named_tensors"][0]]["flattened_tensor"][3] += 1.0  # inside input_layernorm
    with pytest.raises(SGLangPublishError, match=r"midlayer.input_layernorm.weight: reconstructed tensor differs"):
        check_draft_update(requests, cfg, tp_size=1, deserialize=store.deserialize, expected=sd)


def _loaded(client: RecordingClient, store: HandleStore, cfg: Eagle3ExportConfig, calls: slice) -> dict[str, Any]:
    requests = [kw for name, kw in client.calls[calls] if name == "update_weights_from_tensor"]
    return check_draft_update(requests, cfg, tp_size=2, deserialize=store.deserialize)


def test_publisher_versions_drop_stale_and_reapply(draft: tuple[torch.nn.Module, Eagle3ExportConfig]) -> None:
    model, cfg = draft
    store, client = HandleStore(), RecordingClient()
    pub = SGLangDraftPublisher(client, cfg, tp_size=2, serialize=store.serialize, bucket_bytes=64 << 10)
    assert pub.reapply() == -1 and pub.on_resume(None) == -1 and client.calls == []  # nothing published yet
    v3 = mixed_precision(model)
    assert pub.publish(v3, version=3) and (pub.latest_version, pub.applied_version) == (3, 3)
    assert [name for name, _ in client.calls] == (["begin_weight_update"] + ["update_weights_from_tensor"] * 4
                                                  + ["end_weight_update"])
    assert client.calls[0][1] == {"selector": "draft"} and client.calls[-1][1] == {}
    first = _loaded(client, store, cfg, slice(0, 6))
    n_calls = len(client.calls)
    stale = {k: v + 1 if v.is_floating_point() else v for k, v in v3.items()}
    assert not pub.publish(stale, version=3) and not pub.publish(stale, version=2)  # stale: dropped, server untouched
    assert (pub.dropped, len(client.calls), pub.latest_version) == (2, n_calls, 3)
    v3["fc.weight"].add_(1.0)  # the trainer keeps training: the published snapshot must not move
    assert pub.reapply() == 3  # e.g. after the target's own weight sync
    again = _loaded(client, store, cfg, slice(n_calls, None))
    assert list(again) == list(first) and all(_same_bits(again[k], first[k]) for k in first)
    assert pub.on_resume(["kv_cache"]) == -1 and len(client.calls) == 2 * n_calls  # weights kept: nothing to do
    assert pub.on_resume(["weights", "kv_cache"]) == 3 and pub.on_resume(None) == 3
    assert len(client.calls) == 4 * n_calls
    resumed = _loaded(client, store, cfg, slice(3 * n_calls, None))
    assert all(_same_bits(resumed[k], first[k]) for k in first)
    assert pub.publish(stale, version=4) and pub.applied_version == 4
    assert _same_bits(_loaded(client, store, cfg, slice(4 * n_calls, None))["norm.weight"], stale["norm.weight"])


def test_refused_publish_keeps_the_previous_version(draft: tuple[torch.nn.Module, Eagle3ExportConfig]) -> None:
    model, cfg = draft
    store, client = HandleStore(), RecordingClient()
    pub = SGLangDraftPublisher(client, cfg, tp_size=2, serialize=store.serialize, bucket_bytes=64 << 10,
                               weight_version_tag=lambda v: f"draft-{v}")
    v4 = mixed_precision(model)
    assert pub.publish(v4, version=4)
    client.fail_on_call = len(client.calls) + 3  # begin, bucket 1, bucket 2 refused
    v5 = {k: v * 2 if v.is_floating_point() else v for k, v in v4.items()}
    with pytest.raises(SGLangPublishError, match=r"bucket 2/4\): SGLang refused: CUDA out of memory .*version: 4"):
        pub.publish(v5, version=5)
    assert client.calls[-1][0] == "end_weight_update"  # the session is closed even on failure
    assert (pub.latest_version, pub.applied_version, pub.dropped) == (4, None, 0)
    client.fail_on_call = None
    n_calls = len(client.calls)
    assert pub.reapply() == 4 and pub.applied_version == 4  # the half-written v5 is overwritten by v4
    assert _same_bits(_loaded(client, store, cfg, slice(n_calls, None))["lm_head.weight"], v4["lm_head.weight"])
    assert pub.publish(v5, version=5) and pub.applied_version == 5  # the refused version may be sent again
    assert {r["weight_version"] for r in client.updates()} == {"draft-4", "draft-5"}


def test_client_without_session_methods_is_rejected(draft: tuple[torch.nn.Module, Eagle3ExportConfig]) -> None:
    _, cfg = draft

    class EngineLike:
        def update_weights_from_tensor(self, **request: Any) -> tuple[bool, str]:
            return True, "Success"

    with pytest.raises(SGLangPublishError, match=r"client: has no begin_weight_update\(\) \(got EngineLike\)"):
        SGLangDraftPublisher(EngineLike(), cfg)
    assert SGLangDraftPublisher(EngineLike(), cfg, session=False).latest_version is None
