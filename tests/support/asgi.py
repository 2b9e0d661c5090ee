"""The one raw ASGI driver and scope builder, and tiny helpers: scripted `receive`, every `send` recorded.

httpx's ASGITransport cannot deliver a mid-stream disconnect nor show message boundaries,
so tests that care about those use `drive`. `http_scope` builds the scope, with exact raw header
lines when asked; `messages_of` turns body chunks into `http.request` messages for `drive(messages=...)`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from idem_asgi._types import ASGIApp, Message


@dataclass
class Result:
    """What the app sent, message by message."""

    messages: list[Message] = field(default_factory=list)

    @property
    def status(self) -> int:
        return int(next(m["status"] for m in self.messages if m["type"] == "http.response.start"))

    @property
    def headers(self) -> list[tuple[bytes, bytes]]:
        return [tuple(h) for h in next(m for m in self.messages if m["type"] == "http.response.start")["headers"]]

    def header(self, name: str) -> bytes | None:
        raw = name.lower().encode()
        return next((v for k, v in self.headers if k == raw), None)

    @property
    def body(self) -> bytes:
        return b"".join(m.get("body", b"") for m in self.messages if m["type"] == "http.response.body")

    @property
    def chunks(self) -> list[bytes]:
        return [m.get("body", b"") for m in self.messages if m["type"] == "http.response.body"]

    @property
    def started(self) -> Message | None:
        """The `http.response.start` message, or None when the app sent none."""
        return next((m for m in self.messages if m["type"] == "http.response.start"), None)


def http_scope(
    method: str = "POST",
    path: str = "/payments",
    *,
    key: str | None = None,
    headers: Sequence[tuple[str, str]] = (),
    raw_headers: Sequence[tuple[bytes, bytes]] = (),
    query: bytes = b"",
    extensions: dict[str, Any] | None = None,
    state: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """An ASGI HTTP scope. `raw_headers` are header lines exactly as given, in this order; then
    `headers` (lower-cased names, latin-1); `key` adds one Idempotency-Key header last. With
    `state`, the scope carries that `state` dict (as a server with lifespan state gives it)."""
    raw = list(raw_headers)
    raw += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers]
    if key is not None:
        raw.append((b"idempotency-key", key.encode("latin-1")))
    scope: dict[str, Any] = {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode("utf-8", "surrogateescape"),
        "query_string": query,
        "root_path": "",
        "headers": raw,
        "client": ("127.0.0.1", 1234),
        "server": ("127.0.0.1", 80),
        "extensions": extensions or {},
    }
    if state is not None:
        scope["state"] = state
    return scope


def _requests(chunks: Sequence[bytes]) -> list[Message]:
    return [{"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)]


def messages_of(chunks: Sequence[bytes]) -> list[Message]:
    """The body as `http.request` messages, `more_body` true on all but the last (no chunk: one empty one)."""
    return _requests(list(chunks) or [b""])


async def drive(
    app: ASGIApp,
    scope: dict[str, Any],
    body: Sequence[bytes] = (b"",),
    *,
    messages: Sequence[Message] | None = None,
    disconnect_after_first_chunk: bool = False,
    disconnect_when_done: bool = False,
    send_raises_after: int | None = None,
    on_send: Callable[[Message], None] | None = None,
    result: Result | None = None,
) -> Result:
    """Call `app` once. The body is delivered in the given chunks, then the channel waits;
    with `disconnect_after_first_chunk`, `http.disconnect` arrives once the app has sent one
    body chunk; with `disconnect_when_done`, once it sent its last body message (or returned);
    with `send_raises_after=n`, the n+1-th send raises OSError like a gone client.
    `messages` replaces `body`: `receive` hands out exactly these messages, then `http.disconnect`
    at once (a client that left). `on_send` sees each message the client received, as it
    arrives; pass your own `result` to watch the messages arrive while the app still runs."""
    result = Result() if result is None else result
    script = list(messages) if messages is not None else _requests(list(body))
    gone = asyncio.Event()
    if messages is not None:
        gone.set()

    async def receive() -> Message:
        if script:
            return script.pop(0)
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        if send_raises_after is not None and len(result.messages) >= send_raises_after:
            gone.set()
            raise OSError("client disconnected")
        result.messages.append(dict(message))
        if on_send is not None:
            on_send(message)
        if message["type"] == "http.response.body" and (
            disconnect_after_first_chunk or (disconnect_when_done and not message.get("more_body", False))
        ):
            gone.set()

    try:
        await app(scope, receive, send)
    finally:
        if disconnect_when_done:
            gone.set()
    return result


async def read_body(receive: Callable[[], Any]) -> bytes:
    """Read a request body the ASGI way: loop `receive()` until `more_body` is false."""
    parts: list[bytes] = []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            break
        parts.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return b"".join(parts)


class StartupFailed(Exception):
    """The app answered `lifespan.startup.failed`; the message is the server's log line."""


@contextlib.asynccontextmanager
async def lifespan(app: ASGIApp) -> AsyncIterator[None]:
    """Run the app's ASGI lifespan as a server does: startup before the block, shutdown after it."""
    inbox: asyncio.Queue[Message] = asyncio.Queue()
    outbox: asyncio.Queue[Message] = asyncio.Queue()
    scope = {"type": "lifespan", "asgi": {"version": "3.0", "spec_version": "2.0"}, "state": {}}
    task = asyncio.ensure_future(app(scope, inbox.get, outbox.put))

    async def answer_or_crash() -> Message:
        """The app's next message; an app that crashes instead raises its exception at once."""
        reply = asyncio.ensure_future(outbox.get())
        await asyncio.wait({reply, task}, timeout=30, return_when=asyncio.FIRST_COMPLETED)
        if reply.done():
            return reply.result()
        reply.cancel()
        if task.done():
            task.result()  # raises the app's exception
            raise AssertionError("the app returned without answering the lifespan")
        raise AssertionError("the app did not answer the lifespan within 30 s")

    await inbox.put({"type": "lifespan.startup"})
    answer = await answer_or_crash()
    if answer["type"] != "lifespan.startup.complete":
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise StartupFailed(answer.get("message", ""))
    try:
        yield
    finally:
        await inbox.put({"type": "lifespan.shutdown"})
        answer = await answer_or_crash()
        await asyncio.wait_for(task, 30)
        assert answer["type"] == "lifespan.shutdown.complete", answer
