"""Small ASGI helpers shared by the middlewares: a bounded body read and `receive` wrappers."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Final

from .._types import ASGIApp, Message, Receive, Scope, Send
from ..context import STATE_KEY, IdempotencyInfo, enter, leave

HIDDEN_EXTENSIONS: Final = ("http.response.pathsend", "http.response.zerocopysend")
"""Extensions that would let a body bypass `send` (and so the recording): hidden on protected requests."""


class TooLarge(Exception):
    """The body is over the limit (by `Content-Length`, or counted as it arrived)."""


def declared_too_large(scope: Scope, limit: int) -> bool:
    """Whether the request's `Content-Length` already says the body is over `limit`."""
    for k, v in scope["headers"]:
        if k == b"content-length":
            return length_over(v, limit)
    return False


def length_over(value: bytes, limit: int) -> bool:
    """Whether a `Content-Length` value states, as a plain decimal number, more than `limit`.

    Counted in digits before `int()`: Python refuses to convert more than 4,300 (ValueError, so a
    500), and a client can send 5,000. Zeros in front change nothing.
    """
    if not value.isdigit():
        return False
    digits = value.lstrip(b"0")
    return len(digits) > len(str(limit)) or int(digits or b"0") > limit


async def read_chunks(
    receive: Receive, limit: int, feed: Callable[[bytes], object] | None = None, *, first: Message | None = None
) -> list[bytes] | None:
    """The whole request body as the chunks it came in, read the ASGI way; None when the client left first.

    Raises `TooLarge` the moment the body crosses `limit`. `feed` sees each chunk as it arrives
    (an incremental hash), so the body is never walked twice, and it is never joined here: the
    app is handed the same chunks (`replaying`) and joins them itself, as it would without us, so
    a large body is copied once per request, not twice. `first` is a message the caller already received.
    """
    chunks: list[bytes] = []
    size = 0
    while True:
        message = first if first is not None else await receive()
        first = None
        if message["type"] != "http.request":
            return None  # http.disconnect
        chunk = message.get("body", b"")
        if chunk:
            size += len(chunk)
            if size > limit:
                raise TooLarge
            if feed is not None:
                feed(chunk)
            chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks


async def read_body(
    receive: Receive, limit: int, feed: Callable[[bytes], object] | None = None, *, first: Message | None = None
) -> bytes | None:
    """`read_chunks`, joined (one chunk is returned as it came)."""
    chunks = await read_chunks(receive, limit, feed, first=first)
    return None if chunks is None else b"".join(chunks)


def replaying(chunks: Sequence[bytes], receive: Receive) -> Receive:
    """A `receive` that hands the app the buffered body (its chunks, in order) once, then the real channel."""
    sent = 0

    async def replay() -> Message:
        nonlocal sent
        if sent < len(chunks) or not sent:
            i = sent
            sent += 1
            last = sent >= len(chunks)
            return {"type": "http.request", "body": chunks[i] if chunks else b"", "more_body": not last}
        return await receive()

    return replay


async def run_unclaimed(app: ASGIApp, scope: Scope, receive: Receive, send: Send, key: str, owner: str | None) -> None:
    """Run the app with nothing claimed, but hand it the key and scope as usual (fail-open, disabled)."""
    info = IdempotencyInfo(key, owner)
    state = scope.get("state")
    if state is None:
        state = scope["state"] = {}
    state[STATE_KEY] = info
    entered = enter(info)
    try:
        await app(scope, receive, send)
    finally:
        leave(entered)
