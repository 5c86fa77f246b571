"""SGLang's HTTP weight-update API as the `SGLangDraftPublisher` client (standard library only).

`sglang.Engine.update_weights_from_tensor` cannot send `selector`, so a draft-only publish goes
through SGLang's HTTP server: `/begin_weight_update` (selector "draft"), `/update_weights_from_tensor`
(one base64 serialized entry per TP rank), `/end_weight_update`, plus the memory-occupation routes and
`/generate` for the rollout capture. The routes' bodies and replies, from SGLang's source:
docs/design/engines.md section 4.10."""

from __future__ import annotations

import base64
import binascii
import json
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping
from typing import Any

from verl_speco.engines.sglang_publish import (
    OPTIONAL_FIELDS,
    REQUEST_FIELDS,
    SGLangDraftPublisher,
    SGLangPublishError,
)

SELECTORS = ("target", "draft", "all")  # BeginWeightUpdateReqInput / UpdateWeightsFromTensorReqInput.selector
TENSOR_UPDATE_FIELDS = REQUEST_FIELDS + OPTIONAL_FIELDS
ROUTES = ("/begin_weight_update", "/update_weights_from_tensor", "/end_weight_update",
          "/release_memory_occupation", "/resume_memory_occupation", "/generate")


class SGLangHTTPError(SGLangPublishError):
    """An SGLang HTTP call that failed: unreachable, timed out, an HTTP error status or `success: false`.

    `route` is the path called, `status` the HTTP status (None when no reply came back) and
    `message` SGLang's own message (or the transport error)."""

    def __init__(self, base_url: str, route: str, status: int | None, message: str) -> None:
        self.base_url, self.route, self.status, self.message = base_url, route, status, message
        where = f"HTTP {status}" if status is not None else "no reply"
        super().__init__(f"SGLang POST {route} ({base_url}): {where}: {message}")


def _sglang_message(status: int, raw: bytes) -> str:
    """SGLang's message out of an error body: {"message"}, {"error": {"message"}}, {"error": str} or text."""
    text = raw.decode("utf-8", errors="replace").strip()
    try:
        body = json.loads(text)
    except ValueError:
        return text or f"empty body (status {status})"
    if isinstance(body, Mapping):
        if isinstance(body.get("message"), str) and body["message"]:
            return str(body["message"])
        err = body.get("error")
        if isinstance(err, Mapping) and isinstance(err.get("message"), str):
            return str(err["message"])
        if isinstance(err, str):
            return err
        if isinstance(body.get("detail"), str):
            return str(body["detail"])
    return text


def _entry_to_wire(r: int, entry: Any) -> str:
    """One rank's serialized entry as SGLang's HTTP body carries it: a base64 str."""
    if isinstance(entry, bytes | bytearray | memoryview):
        return base64.b64encode(bytes(entry)).decode("ascii")
    if isinstance(entry, str):
        try:
            base64.b64decode(entry, validate=True)
        except (binascii.Error, ValueError) as e:
            raise SGLangPublishError(
                f"serialized_named_tensors[{r}]: a str that is not base64 ({e}); SGLang's deserialize "
                "base64-decodes str entries (serialize(..., output_str=True) makes them)") from None
        return entry
    raise SGLangPublishError(f"serialized_named_tensors[{r}]: got {type(entry).__name__}, expected bytes or a "
                             "base64 str (one per TP rank)")


def _check_selector(selector: Any) -> str:
    if selector not in SELECTORS:
        raise SGLangPublishError(f"selector: got {selector!r}, expected one of {list(SELECTORS)}")
    return str(selector)


class SGLangHTTPClient:
    """Client of one SGLang HTTP server (`--host`/`--port`), the interface `SGLangDraftPublisher` calls.

    Each method POSTs the JSON body SGLang's route parses and returns its reply; any failure
    (unreachable, timeout, status >= 400, `success` false or missing) raises `SGLangHTTPError` naming
    the route, the status and SGLang's message. A body SGLang would not parse raises
    `SGLangPublishError` before anything is sent. `resume_and_reapply` pairs a memory resume with the
    publisher's re-apply."""

    def __init__(self, base_url: str, timeout_s: float, api_key: str | None = None) -> None:
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise SGLangPublishError(f"base_url: got {base_url!r}, expected http(s)://host:port of SGLang's server")
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) or not timeout_s > 0:
            raise SGLangPublishError(f"timeout_s: got {timeout_s!r}, expected a number > 0 (seconds per request)")
        if api_key is not None and (not isinstance(api_key, str) or not api_key):
            raise SGLangPublishError("api_key: expected a non-empty str (SGLang's --api-key) or None")
        self.base_url = base_url.rstrip("/")
        self.timeout_s = float(timeout_s)
        self._api_key = api_key

    def __repr__(self) -> str:  # never shows the key
        return f"SGLangHTTPClient({self.base_url!r}, timeout_s={self.timeout_s})"

    # --- the publisher's interface (sglang_publish.SGLangClient + session methods) ---

    def begin_weight_update(self, selector: str = "all") -> dict[str, Any]:
        """Open SGLang's weight-update session for the runners `selector` names."""
        return self._post_checked("/begin_weight_update", {"selector": _check_selector(selector)})

    def end_weight_update(self) -> dict[str, Any]:
        """Close the open weight-update session."""
        return self._post_checked("/end_weight_update", {})

    def update_weights_from_tensor(self, **request: Any) -> dict[str, Any]:
        """POST one `UpdateWeightsFromTensorReqInput`; bytes entries of `serialized_named_tensors` go as base64."""
        unknown = sorted(set(request) - set(TENSOR_UPDATE_FIELDS))
        if unknown:
            raise SGLangPublishError(f"update_weights_from_tensor: unknown fields {unknown}; SGLang's "
                                     f"UpdateWeightsFromTensorReqInput has {list(TENSOR_UPDATE_FIELDS)}")
        entries = request.get("serialized_named_tensors")
        if not isinstance(entries, list | tuple) or not entries:
            raise SGLangPublishError("update_weights_from_tensor: serialized_named_tensors must be a non-empty list "
                                     "(one entry per TP rank)")
        body = dict(request)
        body["serialized_named_tensors"] = [_entry_to_wire(r, e) for r, e in enumerate(entries)]
        if "selector" in body:
            _check_selector(body["selector"])
        return self._post_checked("/update_weights_from_tensor", body)

    # --- generation (the rollout capture's requests, `verl_speco.engines.sglang_capture`) ---

    def generate(self, input_ids: list[int], sampling_params: Mapping[str, Any],
                 **fields: Any) -> dict[str, Any]:
        """POST /generate (`GenerateReqInput`: `input_ids`, `sampling_params`, plus `fields` such as
        `return_hidden_states`); SGLang's reply {"text", "output_ids", "meta_info"} for one prompt."""
        if not input_ids or not all(isinstance(t, int) and not isinstance(t, bool) for t in input_ids):
            raise SGLangPublishError(f"input_ids: got {input_ids!r:.80}, expected a non-empty list of token ids")
        reply = self._post("/generate", {"input_ids": list(input_ids), "sampling_params": dict(sampling_params),
                                         **fields})
        if not isinstance(reply, dict) or not isinstance(reply.get("output_ids"), list) \
                or not isinstance(reply.get("meta_info"), dict):
            raise SGLangHTTPError(self.base_url, "/generate", 200, f"unexpected reply {str(reply)[:200]}, expected "
                                  '{"output_ids": [...], "meta_info": {...}}')
        return reply

    # --- memory (weights paused/resumed; the draft must be re-published after a resume) ---

    def release_memory_occupation(self, tags: Iterable[str] | None = None) -> None:
        """Release GPU memory (`tags`: e.g. ["weights", "kv_cache"]; None = all)."""
        self._post("/release_memory_occupation", {"tags": self._tags(tags)})

    def resume_memory_occupation(self, tags: Iterable[str] | None = None) -> None:
        """Take the released memory back; follow with `SGLangDraftPublisher.on_resume(tags)`."""
        self._post("/resume_memory_occupation", {"tags": self._tags(tags)})

    # --- transport ---

    @staticmethod
    def _tags(tags: Iterable[str] | None) -> list[str] | None:
        if tags is None:
            return None
        out = list(tags)
        if not all(isinstance(t, str) for t in out):
            raise SGLangPublishError(f"tags: got {out!r}, expected strings")
        return out

    def _post_checked(self, route: str, body: Mapping[str, Any]) -> dict[str, Any]:
        reply = self._post(route, body)
        if not isinstance(reply, dict) or not isinstance(reply.get("success"), bool):
            raise SGLangHTTPError(self.base_url, route, 200, f"unexpected reply {reply!r}, expected "
                                  '{"success": bool, "message": str}')
        if not reply["success"]:
            raise SGLangHTTPError(self.base_url, route, 200, str(reply.get("message", "")) or "success: false")
        return reply

    def _post(self, route: str, body: Mapping[str, Any]) -> Any:
        """POST `body` as JSON; the decoded JSON reply (None for an empty body or `null`)."""
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if self._api_key is not None:
            headers["Authorization"] = f"Bearer {self._api_key}"
        req = urllib.request.Request(self.base_url + route, data=json.dumps(body).encode("utf-8"),
                                     headers=headers, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                status, raw = resp.status, resp.read()
        except urllib.error.HTTPError as e:
            try:
                raw = e.read()
            finally:
                e.close()
            raise SGLangHTTPError(self.base_url, route, e.code, _sglang_message(e.code, raw)) from None
        except TimeoutError:
            raise SGLangHTTPError(self.base_url, route, None, f"timed out after {self.timeout_s:g} s") from None
        except urllib.error.URLError as e:
            if isinstance(e.reason, TimeoutError):
                raise SGLangHTTPError(self.base_url, route, None,
                                      f"timed out after {self.timeout_s:g} s") from None
            raise SGLangHTTPError(self.base_url, route, None, f"unreachable: {e.reason}") from None
        except OSError as e:  # connection reset mid-reply and the like
            raise SGLangHTTPError(self.base_url, route, None, f"connection failed: {e}") from None
        if status >= 400:  # urllib raises HTTPError for these; kept for custom openers
            raise SGLangHTTPError(self.base_url, route, status, _sglang_message(status, raw))
        text = raw.decode("utf-8", errors="replace").strip()
        if not text:
            return None
        try:
            return json.loads(text)
        except ValueError:
            raise SGLangHTTPError(self.base_url, route, status, f"reply is not JSON: {text[:200]!r}") from None


def resume_and_reapply(client: SGLangHTTPClient, publisher: SGLangDraftPublisher,
                       tags: Iterable[str] | None = None) -> int:
    """`resume_memory_occupation(tags)` then `publisher.on_resume(tags)`: the draft version re-applied, or -1."""
    tag_list = None if tags is None else list(tags)
    client.resume_memory_occupation(tag_list)
    return publisher.on_resume(tag_list)
