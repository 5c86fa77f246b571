"""`SGLangHTTPClient` against a real local HTTP server implementing SGLang's weight-update routes.

The server (`FakeSGLang`, an `http.server.ThreadingHTTPServer` on 127.0.0.1:0) is a contract
double of SGLang's `entrypoints/http_server.py`: each body must be a JSON object whose fields are
those of SGLang's request dataclass (`managers/io_struct.py`: `BeginWeightUpdateReqInput`,
`EndWeightUpdateReqInput`, `UpdateWeightsFromTensorReqInput`, `ReleaseMemoryOccupationReqInput`,
`ResumeMemoryOccupationReqInput`) with their types, a body that fails gets FastAPI's 400
`ErrorResponse`; replies are `{"success", "message"}` (200, or 400 when refused) for the weight
routes and `null` for the memory routes; `serialized_named_tensors` entries are base64 str, decoded
with `validate=True` as `MultiprocessingSerializer.deserialize` does; updates are refused outside
a `begin_weight_update` ... `end_weight_update` session, and only one session may be open.

SGLang's pickling serializer is replaced by a non-pickling codec (a JSON header of the bucket
metadata + the bucket's raw bytes), so every tensor really crosses HTTP and is rebuilt from the
bytes the server received: bit-exactness is checked on what arrived, NaN and -0.0 included.
"""

from __future__ import annotations

import base64
import binascii
import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
import torch

from drafters.eagle3.export import Eagle3ExportConfig
from verl_speco.engines.sglang_http import SGLangHTTPClient, SGLangHTTPError, resume_and_reapply
from verl_speco.engines.sglang_publish import (
    REQUEST_FIELDS,
    FlatTensorMeta,
    SGLangDraftPublisher,
    SGLangPublishError,
    check_draft_update,
)
from verl_speco.ports import free_port

API_KEY = "test-admin-key"
NONE = type(None)
# Field names and JSON types of SGLang's request dataclasses (managers/io_struct.py), per route.
FIELDS: dict[str, dict[str, tuple[type, ...]]] = {
    "/begin_weight_update": {"selector": (str,)},  # BeginWeightUpdateReqInput
    "/end_weight_update": {},  # EndWeightUpdateReqInput
    "/update_weights_from_tensor": {  # UpdateWeightsFromTensorReqInput
        "serialized_named_tensors": (list,), "load_format": (str, NONE), "flush_cache": (bool,),
        "abort_all_requests": (bool,), "weight_version": (str, NONE), "selector": (str,),
        "torch_empty_cache": (bool,)},
    "/release_memory_occupation": {"tags": (list, NONE)},  # ReleaseMemoryOccupationReqInput
    "/resume_memory_occupation": {"tags": (list, NONE)},  # ResumeMemoryOccupationReqInput
}
REQUIRED = {"/update_weights_from_tensor": ("serialized_named_tensors",)}
SELECTORS = ("target", "draft", "all")
MATRICES = ("fc.weight", "midlayer.self_attn.q_proj.weight", "midlayer.self_attn.k_proj.weight",
            "midlayer.self_attn.v_proj.weight", "midlayer.self_attn.o_proj.weight", "midlayer.mlp.gate_proj.weight",
            "midlayer.mlp.up_proj.weight", "midlayer.mlp.down_proj.weight", "lm_head.weight")
UPDATE = "/update_weights_from_tensor"


@dataclass
class Call:
    route: str
    body: dict[str, Any]
    decoded: list[bytes] | None = None  # update: each rank's entry, base64-decoded


class FakeSGLang:
    """SGLang's weight-update HTTP routes as a contract double; records every accepted call."""

    def __init__(self, api_key: str | None = API_KEY) -> None:
        self.api_key = api_key
        self.calls: list[Call] = []  # accepted (validated) calls, in arrival order
        self.seen: list[str] = []  # every request's route, accepted or not
        self.session: str | None = None  # the open session's selector
        self.released: set[str] = set()
        self.inject: dict[tuple[str, int], tuple[int, bytes]] = {}  # (route, n-th call) -> canned reply
        self.delay: dict[str, float] = {}
        self.lock = threading.Lock()
        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def routes(self, start: int = 0) -> list[str]:
        return [c.route for c in self.calls[start:]]

    def tensor_updates(self, start: int = 0) -> list[dict[str, Any]]:
        """The accepted update requests from `start` on, entries as the bytes SGLang would deserialize."""
        return [{**c.body, "serialized_named_tensors": c.decoded} for c in self.calls[start:] if c.route == UPDATE]

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        fake = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:  # quiet
                pass

            def _reply(self, status: int, raw: bytes, ctype: str = "application/json") -> None:
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(raw)))
                try:
                    self.end_headers()
                    self.wfile.write(raw)
                except (BrokenPipeError, ConnectionResetError):  # the client gave up (timeout test)
                    pass

            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                route = self.path
                with fake.lock:
                    fake.seen.append(route)
                    nth = fake.seen.count(route)
                    status, out = fake._serve(route, nth, self.headers.get("Authorization"),
                                              self.headers.get("Content-Type", ""), raw)
                time.sleep(fake.delay.get(route, 0.0))
                self._reply(status, out, "application/json" if out[:1] in (b"{", b"n") else "text/plain")

        return Handler

    def _serve(self, route: str, nth: int, auth: str | None, ctype: str, raw: bytes) -> tuple[int, bytes]:
        if self.api_key is not None and auth != f"Bearer {self.api_key}":  # utils add_api_key_middleware
            return 401, json.dumps({"error": "Unauthorized"}).encode()
        if route not in FIELDS:
            return 404, json.dumps({"detail": "Not Found"}).encode()
        if (route, nth) in self.inject:
            return self.inject[(route, nth)]
        try:
            body = json.loads(raw)
        except ValueError:
            body = None
        problem = self._validate(route, ctype, body)
        if problem:  # http_server's RequestValidationError handler: 400 with ErrorResponse
            return 400, json.dumps({"object": "error", "message": problem, "type": "Bad Request", "param": None,
                                    "code": 400}).encode()
        assert isinstance(body, dict)
        ok, message, decoded = self._apply(route, body)
        if route in ("/release_memory_occupation", "/resume_memory_occupation"):
            return 200, b"null"  # the route returns nothing on success
        if ok:
            self.calls.append(Call(route, body, decoded))
        return (200 if ok else 400), json.dumps({"success": ok, "message": message}).encode()

    def _validate(self, route: str, ctype: str, body: Any) -> str:
        if ctype.split(";")[0].strip().lower() != "application/json":
            return f"content-type {ctype!r}, expected application/json"
        if not isinstance(body, dict):
            return f"body: {type(body).__name__}, expected a JSON object"
        fields = FIELDS[route]
        unknown = sorted(set(body) - set(fields))
        missing = [k for k in REQUIRED.get(route, ()) if k not in body]
        if unknown or missing:
            return f"unknown fields {unknown}, missing {missing}"
        for key, value in body.items():
            if not isinstance(value, fields[key]) or (bool not in fields[key] and isinstance(value, bool)):
                return f"{key}: {type(value).__name__}, expected {[t.__name__ for t in fields[key]]}"
        if "selector" in body and body["selector"] not in SELECTORS:
            return f"selector: {body['selector']!r}, expected one of {list(SELECTORS)}"
        for key in ("serialized_named_tensors", "tags"):
            if isinstance(body.get(key), list) and not all(isinstance(e, str) for e in body[key]):
                return f"{key}: expected a list of str"
        return ""

    def _apply(self, route: str, body: dict[str, Any]) -> tuple[bool, str, list[bytes] | None]:
        if route == "/begin_weight_update":
            if self.session is not None:
                return False, f"a weight update session is already open (selector {self.session!r})", None
            self.session = body.get("selector", "all")
            return True, "Succeeded to begin weight update.", None
        if route == "/end_weight_update":
            if self.session is None:
                return False, "end_weight_update requires an open session", None
            self.session = None
            return True, "Succeeded to end weight update.", None
        if route == UPDATE:
            if self.session is None:
                return False, "update_weights_from_tensor requires an open session", None
            if body.get("selector", "all") != self.session:  # this double's own stricter check
                return False, f"selector {body.get('selector', 'all')!r} outside a {self.session!r} session", None
            if "weights" in self.released:
                return False, "model weights are released", None
            try:  # MultiprocessingSerializer.deserialize: b64decode(str, validate=True)
                decoded = [base64.b64decode(e, validate=True) for e in body["serialized_named_tensors"]]
            except (binascii.Error, ValueError) as e:
                return False, f"serialized_named_tensors: not base64 ({e})", None
            return True, "Succeeded to update model weights.", decoded
        tags = set(body.get("tags") or ("weights", "kv_cache", "cuda_graph"))
        if route == "/release_memory_occupation":
            self.released |= tags
        else:
            self.released -= tags
        self.calls.append(Call(route, body))
        return True, "", None


class RawBucketCodec:
    """Non-pickling stand-in for SGLang's serializer: JSON header of the bucket metadata, newline, raw bytes."""

    @staticmethod
    def encode(payload: Any) -> bytes:
        flat = payload["flattened_tensor"].detach().cpu().contiguous()
        header = {"dtype": str(flat.dtype).removeprefix("torch."),
                  "metadata": [[m.name, list(m.shape), str(m.dtype).removeprefix("torch."), m.start_idx, m.end_idx,
                                m.numel] for m in payload["metadata"]]}
        return json.dumps(header).encode() + b"\n" + flat.view(torch.uint8).numpy().tobytes()

    @staticmethod
    def decode(data: bytes | str) -> dict[str, Any]:
        raw = base64.b64decode(data, validate=True) if isinstance(data, str) else data
        head, body = raw.split(b"\n", 1)
        header = json.loads(head)
        flat = torch.frombuffer(bytearray(body), dtype=torch.uint8).view(getattr(torch, header["dtype"]))
        meta = [FlatTensorMeta(n, torch.Size(s), getattr(torch, d), a, b, k) for n, s, d, a, b, k in header["metadata"]]
        return {"flattened_tensor": flat, "metadata": meta}


def serving(fake: FakeSGLang) -> Iterator[FakeSGLang]:
    """Serve `fake` on a background thread for the duration of a fixture."""
    thread = threading.Thread(target=fake.httpd.serve_forever, daemon=True)
    thread.start()
    yield fake
    fake.httpd.shutdown()
    fake.httpd.server_close()
    thread.join(timeout=5)


@pytest.fixture
def sglang() -> Iterator[FakeSGLang]:
    yield from serving(FakeSGLang())


def state(model: torch.nn.Module, scale: float = 1.0) -> dict[str, torch.Tensor]:
    """bf16 matrices, fp32 norms (two dtype buckets), with a NaN and a -0.0 that must survive bit for bit."""
    sd = {k: v.detach().clone() * scale if v.is_floating_point() else v.detach().clone()
          for k, v in model.state_dict().items()}
    sd = {k: v.to(torch.bfloat16) if k in MATRICES else v for k, v in sd.items()}
    sd["norm.weight"][7] = float("nan")
    sd["midlayer.hidden_norm.weight"][0] = -0.0
    return sd


def assert_sessions_wrap_updates(routes: list[str]) -> None:
    """Every accepted update lies inside one begin ... end and no session is left open."""
    open_ = False
    for route in routes:
        if route == "/begin_weight_update":
            assert not open_, routes
            open_ = True
        elif route == "/end_weight_update":
            assert open_, routes
            open_ = False
        elif route == UPDATE:
            assert open_, routes
    assert not open_, routes


def received(fake: FakeSGLang, cfg: Eagle3ExportConfig, start: int, expected: dict[str, torch.Tensor]) -> dict[str, Any]:
    """What rank 0 loads from the updates accepted since `start`, checked bit for bit against `expected`."""
    return check_draft_update(fake.tensor_updates(start), cfg, tp_size=2,
                              deserialize=RawBucketCodec.decode, expected=expected)


def test_publisher_over_http_round_trips_bit_exactly(draft: tuple[torch.nn.Module, Eagle3ExportConfig],
                                                      sglang: FakeSGLang) -> None:
    model, cfg = draft
    client = SGLangHTTPClient(sglang.url + "/", timeout_s=30, api_key=API_KEY)
    pub = SGLangDraftPublisher(client, cfg, tp_size=2, serialize=RawBucketCodec.encode, bucket_bytes=64 << 10)
    v3 = state(model)
    assert pub.publish(v3, version=3) and pub.applied_version == 3
    assert sglang.routes() == ["/begin_weight_update"] + [UPDATE] * 4 + ["/end_weight_update"]
    assert sglang.calls[0].body == {"selector": "draft"} and sglang.calls[-1].body == {}
    updates = [c.body for c in sglang.calls if c.route == UPDATE]
    assert all(tuple(b) == REQUEST_FIELDS and b["selector"] == "draft" for b in updates)  # the JSON body, as sent
    assert [b["flush_cache"] for b in updates] == [False, False, False, True]
    assert all(len(b["serialized_named_tensors"]) == 2 and all(isinstance(e, str) for e in b["serialized_named_tensors"])
               for b in updates)  # base64 str on the wire, one per TP rank
    loaded = received(sglang, cfg, 0, v3)
    assert torch.isnan(loaded["norm.weight"][7]) and torch.signbit(loaded["midlayer.hidden_norm.weight"][0])
    assert sglang.session is None

    n, sent = len(sglang.calls), len(sglang.seen)
    v4 = state(model, scale=2.0)
    assert not pub.publish(v4, version=3) and not pub.publish(v4, version=2)  # stale: dropped, nothing sent
    assert (pub.dropped, len(sglang.seen), pub.latest_version) == (2, sent, 3)
    assert pub.publish(v4, version=4) and pub.applied_version == 4
    received(sglang, cfg, n, v4)

    n = len(sglang.calls)
    client.release_memory_occupation(["weights", "kv_cache"])
    assert sglang.released == {"weights", "kv_cache"}
    assert resume_and_reapply(client, pub, ["weights", "kv_cache"]) == 4  # weights came back: v4 again
    assert sglang.routes(n) == (["/release_memory_occupation", "/resume_memory_occupation", "/begin_weight_update"]
                                + [UPDATE] * 4 + ["/end_weight_update"])
    assert sglang.calls[n].body == {"tags": ["weights", "kv_cache"]}
    received(sglang, cfg, n, v4)
    n = len(sglang.calls)
    client.release_memory_occupation(["kv_cache"])
    assert resume_and_reapply(client, pub, ["kv_cache"]) == -1  # weights kept: no re-apply
    assert sglang.routes(n) == ["/release_memory_occupation", "/resume_memory_occupation"]
    assert_sessions_wrap_updates(sglang.routes())


@pytest.mark.parametrize(("route", "nth", "status", "body", "message"), [
    (UPDATE, 6, 400, {"success": False, "message": "CUDA out of memory"},
     r"POST /update_weights_from_tensor \(http://127\.0\.0\.1:\d+\): HTTP 400: CUDA out of memory"),
    (UPDATE, 6, 500, b"Internal Server Error", r"POST /update_weights_from_tensor .*HTTP 500: Internal Server Error"),
    (UPDATE, 5, 200, {"success": False, "message": "weights not loaded"},
     r"POST /update_weights_from_tensor .*HTTP 200: weights not loaded"),
    ("/begin_weight_update", 2, 400, {"success": False, "message": "a weight update session is already open"},
     r"POST /begin_weight_update .*HTTP 400: a weight update session is already open"),
    ("/end_weight_update", 2, 503, {"error": {"message": "scheduler is gone"}},
     r"POST /end_weight_update .*HTTP 503: scheduler is gone"),
])
def test_refusals_raise_naming_route_status_and_message(draft: tuple[torch.nn.Module, Eagle3ExportConfig],
                                                        sglang: FakeSGLang, route: str, nth: int, status: int,
                                                        body: Any, message: str) -> None:
    model, cfg = draft
    client = SGLangHTTPClient(sglang.url, timeout_s=30, api_key=API_KEY)
    pub = SGLangDraftPublisher(client, cfg, tp_size=2, serialize=RawBucketCodec.encode, bucket_bytes=64 << 10)
    assert pub.publish(state(model), version=3)  # 4 updates: a 5th/6th call is the next version's 1st/2nd bucket
    sglang.inject[(route, nth)] = (status, body if isinstance(body, bytes) else json.dumps(body).encode())
    with pytest.raises(SGLangHTTPError, match=message) as info:
        pub.publish(state(model, scale=2.0), version=4)
    assert (info.value.route, info.value.status) == (route, status) and isinstance(info.value, SGLangPublishError)
    assert (pub.latest_version, pub.applied_version) == (3, None)
    if route == "/begin_weight_update":
        assert sglang.seen[-1] == "/begin_weight_update"  # no session opened: nothing else sent
    else:
        assert sglang.seen[-1] == "/end_weight_update"  # the publisher closes the session even on failure
    if route == "/end_weight_update":  # the server never closed it: SGLang's refusal is named on the next try
        with pytest.raises(SGLangHTTPError, match=r"/begin_weight_update .*HTTP 400: .*already open"):
            pub.reapply()
        sglang.session = None
    else:  # the refused publish was wrapped too: begin, the buckets accepted before the refusal, end
        assert_sessions_wrap_updates(sglang.routes())
    n = len(sglang.calls)
    assert pub.reapply() == 3 and pub.applied_version == 3  # v3 restored over any half-written v4
    assert sglang.routes(n) == ["/begin_weight_update"] + [UPDATE] * 4 + ["/end_weight_update"]
    received(sglang, cfg, n, state(model))


def test_server_side_rejections_carry_sglangs_message(sglang: FakeSGLang) -> None:
    client = SGLangHTTPClient(sglang.url, timeout_s=30, api_key=API_KEY)
    entry = [b"\x00payload"]
    with pytest.raises(SGLangHTTPError, match=r"/update_weights_from_tensor .*HTTP 400: .*requires an open session"):
        client.update_weights_from_tensor(serialized_named_tensors=entry, selector="draft")
    with pytest.raises(SGLangHTTPError, match=r"/end_weight_update .*HTTP 400: .*requires an open session"):
        client.end_weight_update()
    assert client.begin_weight_update(selector="draft")["success"] is True
    with pytest.raises(SGLangHTTPError, match=r"HTTP 400: flush_cache: str, expected \['bool'\]"):  # ErrorResponse
        client.update_weights_from_tensor(serialized_named_tensors=entry, selector="draft", flush_cache="yes")
    assert client.update_weights_from_tensor(serialized_named_tensors=entry, selector="draft")["success"] is True
    assert sglang.calls[-1].decoded == [b"\x00payload"]  # bytes -> base64 -> the same bytes
    assert client.end_weight_update()["success"] is True
    with pytest.raises(SGLangHTTPError, match=r"/begin_weight_update .*HTTP 401: Unauthorized") as info:
        SGLangHTTPClient(sglang.url, timeout_s=30).begin_weight_update(selector="draft")  # no --api-key sent
    assert info.value.status == 401 and "test-admin-key" not in repr(client)


def test_bodies_sglang_would_not_parse_are_refused_before_sending(sglang: FakeSGLang) -> None:
    client = SGLangHTTPClient(sglang.url, timeout_s=30, api_key=API_KEY)
    cases: list[tuple[dict[str, Any], str]] = [
        (dict(serialized_named_tensors=[b"x"], disable_draft_model=True), r"unknown fields \['disable_draft_model'\]"),
        (dict(serialized_named_tensors=[b"x"], selector="drafts"), r"selector: got 'drafts'"),
        (dict(serialized_named_tensors=[]), r"non-empty list"),
        (dict(serialized_named_tensors=[b"x", 3]), r"serialized_named_tensors\[1\]: got int"),
        (dict(serialized_named_tensors=["not base64!"]), r"serialized_named_tensors\[0\]: a str that is not base64"),
    ]
    for kwargs, message in cases:
        with pytest.raises(SGLangPublishError, match=message):
            client.update_weights_from_tensor(**kwargs)
    with pytest.raises(SGLangPublishError, match=r"selector: got 'both'"):
        client.begin_weight_update(selector="both")
    with pytest.raises(SGLangPublishError, match=r"tags: got \[1\]"):
        client.release_memory_occupation([1])  # type: ignore[list-item]  # a wrong tag type
    assert sglang.seen == []
    with pytest.raises(SGLangPublishError, match=r"base_url: got 'localhost:30000'"):
        SGLangHTTPClient("localhost:30000", timeout_s=1)
    with pytest.raises(SGLangPublishError, match=r"timeout_s: got 0"):
        SGLangHTTPClient(sglang.url, timeout_s=0)
    # a str entry already in base64 (SGLang's serialize(..., output_str=True)) goes through unchanged
    assert client.begin_weight_update(selector="draft")["success"]
    client.update_weights_from_tensor(serialized_named_tensors=[base64.b64encode(b"abc").decode()], selector="draft")
    assert sglang.calls[-1].decoded == [b"abc"]


def test_unreachable_and_slow_servers_name_the_route(sglang: FakeSGLang) -> None:
    port = free_port("127.0.0.1")  # a port nobody listens on
    with pytest.raises(SGLangHTTPError, match=r"POST /begin_weight_update \(http://127\.0\.0\.1:\d+\): no reply: "
                                              r"unreachable") as info:
        SGLangHTTPClient(f"http://127.0.0.1:{port}", timeout_s=5).begin_weight_update(selector="draft")
    assert info.value.status is None
    sglang.delay["/begin_weight_update"] = 1.0
    with pytest.raises(SGLangHTTPError, match=r"POST /begin_weight_update .*no reply: timed out after 0.2 s"):
        SGLangHTTPClient(sglang.url, timeout_s=0.2, api_key=API_KEY).begin_weight_update(selector="draft")
