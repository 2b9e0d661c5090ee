"""The JSON-RPC side of `IdempotentTools`: which request is a `tools/call` and what it asks, the
app's answer read while it is sent on (one JSON body or an SSE stream), and the responses the
wrapper sends itself (a replay under the repeat's own id, a refusal as a JSON-RPC error whose
`error.data` is the HTTP middleware's problem)."""

from __future__ import annotations

import hashlib
import json
from typing import Any, Final

import msgspec

from .._types import Message, Receive, Scope, Send
from ..http import problems
from ..http.problems import ProblemType

CODES: Final[dict[str, int]] = {
    problems.IN_PROGRESS.slug: -32010,
    problems.FINGERPRINT_MISMATCH.slug: -32011,
    problems.OUTCOME_UNKNOWN.slug: -32012,
    problems.STORE_UNAVAILABLE.slug: -32013,
    problems.STORE_MISCONFIGURED.slug: -32014,
    problems.KEY_REQUIRED.slug: -32015,
    problems.KEY_MALFORMED.slug: -32016,
    problems.SCOPE_REQUIRED.slug: -32017,
    problems.SCOPE_MALFORMED.slug: -32018,
    problems.KEY_QUOTA.slug: -32019,
}
"""The JSON-RPC `error.code` of each refusal, by problem slug: in the band the MCP spec leaves to
implementations (-32000..-32019), clear of the SDK's own -32000 and -32001."""
CANCELLED: Final = -32800
"""The 2025-era transport's error for a request the client cancelled: an interruption, not a refusal."""
REPLAYED: Final = (b"idempotent-replayed", b"true")
_encode = msgspec.json.encode


class Call(msgspec.Struct, frozen=True):
    """One JSON-RPC `tools/call` request: its id, tool, `params._meta` and fingerprint."""

    id: str | int
    name: str
    meta: dict[str, Any]
    fingerprint: bytes


def tool_call(body: bytes) -> Call | None:
    """The `tools/call` request this body is, or None (anything else passes through)."""
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(doc, dict) or doc.get("method") != "tools/call":
        return None
    rid, params = doc.get("id"), doc.get("params")
    if isinstance(rid, bool) or not isinstance(rid, (str, int)) or not isinstance(params, dict):
        return None
    name, arguments, meta = params.get("name"), params.get("arguments", {}), params.get("_meta", {})
    if not isinstance(name, str) or not isinstance(arguments, dict) or not isinstance(meta, dict):
        return None
    return Call(rid, name, meta, fingerprint(name, arguments))


def fingerprint(name: str, arguments: dict[str, Any]) -> bytes:
    """SHA-256 of the tool's name and its arguments as canonical JSON (keys sorted): `_meta` (the
    client's envelope, its key, a progress token) is not part of what the call asks for."""
    text = json.dumps([name, arguments], sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()


async def read(receive: Receive, limit: int) -> tuple[list[Message], bool]:
    """The request's messages as received, and whether they hold the whole body within `limit`."""
    messages: list[Message] = []
    size = 0
    while True:
        message = await receive()
        messages.append(message)
        if message["type"] != "http.request":
            return messages, False
        size += len(message.get("body", b""))
        if size > limit:
            return messages, False
        if not message.get("more_body", False):
            return messages, True


def replaying(messages: list[Message], receive: Receive) -> Receive:
    """A `receive` that hands the app the messages already read, as they were, then the real channel."""
    pending = list(messages)

    async def replay() -> Message:
        return pending.pop(0) if pending else await receive()

    return replay


class Answer:
    """The app's answer, sent on as it comes while the JSON-RPC response to `rid` is read from it
    (one JSON body, or an SSE stream whose notifications and requests are skipped). A client gone
    meanwhile does not stop the app: its answer is still read, and stored."""

    __slots__ = ("_send", "body", "found", "gone", "rid", "sse", "status")

    def __init__(self, send: Send, rid: str | int) -> None:
        self._send = send
        self.rid = rid
        self.status: int | None = None
        self.sse = False
        self.body = bytearray()
        self.found: dict[str, Any] | None = None
        self.gone = False

    @property
    def cut(self) -> bool:
        """No answer to the call: none started, an SSE stream that ended without one (the client went
        away, the server stopped), or the client's cancellation. The tool may have run."""
        if self.found is None:
            return self.status is None or self.sse
        error = self.found.get("error")
        return isinstance(error, dict) and error.get("code") == CANCELLED

    async def send(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            self.status = message["status"]
            kind = next((v for k, v in message.get("headers", []) if k.lower() == b"content-type"), b"")
            self.sse = kind.lower().startswith(b"text/event-stream")
        elif message["type"] == "http.response.body":
            self.body += message.get("body", b"")
            if self.sse:
                self._events()
            elif not message.get("more_body", False):
                self._read(bytes(self.body))
        if self.gone:
            return
        try:
            await self._send(message)
        except Exception:  # the client is gone: the app finishes, and its answer is still stored
            self.gone = True

    def _events(self) -> None:
        cut = len(self.body) - self.body.endswith(b"\r")  # a lone CR may be half of a CRLF
        text = bytes(self.body[:cut]).replace(b"\r\n", b"\n").replace(b"\r", b"\n")
        *events, rest = text.split(b"\n\n")
        self.body = bytearray(rest) + self.body[cut:]
        for event in events:
            lines = [line[5:].removeprefix(b" ") for line in event.split(b"\n") if line.startswith(b"data:")]
            if lines:
                self._read(b"\n".join(lines))

    def _read(self, data: bytes) -> None:
        if self.found is not None:
            return
        try:
            doc = json.loads(data)
        except (ValueError, RecursionError):
            return
        if not isinstance(doc, dict) or ("result" not in doc and "error" not in doc):
            return  # a notification or a server-to-client request
        rid = doc.get("id")
        ours = rid == self.rid and type(rid) is type(self.rid)
        if ours or ("error" in doc and rid is None):  # (an error with no id: the request was refused)
            self.found = doc

    def result(self) -> dict[str, Any] | None:
        """The call's final `result`, to store and replay: not an error, not a tool that failed
        (`isError`), not a request for more input (`resultType: input_required`, which the client
        answers by calling again with the same arguments: that call must run)."""
        result = None if self.found is None else self.found.get("result")
        if not isinstance(result, dict) or result.get("isError") is True:
            return None
        return result if result.get("resultType", "complete") != "input_required" else None


def error(problem: ProblemType, detail: str | None = None, *, retry_after: int | None = None) -> dict[str, Any]:
    """A JSON-RPC `error` member whose `data` is the HTTP middleware's problem document."""
    data: dict[str, Any] = {
        "type": problem.type,
        "title": problem.title,
        "status": problem.status,
        "detail": detail or problem.detail,
    }
    if retry_after is not None:
        data["retry_after"] = retry_after
    return {"error": {"code": CODES[problem.slug], "message": problem.title, "data": data}}


async def respond(scope: Scope, send: Send, rid: str | int, member: dict[str, Any], *, replayed: bool = False) -> None:
    """Send one JSON-RPC response (HTTP 200) for `rid`: `application/json` when the request accepts
    it, else one SSE `message` event; the request's `mcp-session-id` carried back, as the SDK does."""
    doc = _encode({"jsonrpc": "2.0", "id": rid, **member})
    accept = b",".join(v for k, v in scope["headers"] if k == b"accept").lower()
    kinds = {part.split(b";")[0].strip() for part in accept.split(b",")} if accept else {b"*/*"}
    if kinds & {b"application/json", b"application/*", b"*/*"} or b"text/event-stream" not in kinds:
        headers = [(b"content-type", b"application/json")]
        body = doc
    else:
        headers = [(b"content-type", b"text/event-stream")]
        body = b"event: message\r\ndata: " + doc + b"\r\n\r\n"
    headers.append((b"content-length", str(len(body)).encode("ascii")))
    headers += [(k, v) for k, v in scope["headers"] if k == b"mcp-session-id"][:1]
    headers.append(REPLAYED if replayed else (b"cache-control", b"no-store"))
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
