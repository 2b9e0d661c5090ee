"""Per-request send wrapper: streams the answer to the client while recording it verbatim.

Every message but the last goes to the client as soon as the app sends it. The last one (the
final body chunk, or the final trailers message when the app announced trailers) is held just
long enough to write the completion, so a client that has the whole answer and retries always
finds it stored. The client hanging up never stops the recording.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Container

import anyio

from ._types import Message, Send
from .records import StoredResponse

OnFinal = Callable[[StoredResponse], Awaitable[None]]
Pairs = list[tuple[bytes, bytes]]


def _pairs(raw: object, excluded: Container[bytes]) -> Pairs:
    pairs: Pairs = []
    for k, v in raw:  # type: ignore[attr-defined]
        # bytes() only for the rare bytearray/memoryview: a no-op call per header otherwise
        if k.__class__ is not bytes:
            k = bytes(k)
        if v.__class__ is not bytes:
            v = bytes(v)
        if k.lower() not in excluded:
            pairs.append((k, v))
    return pairs


class Capture:
    """The `send` the app sees on a protected request."""

    __slots__ = (
        "_chunks",
        "_excluded",
        "_headers",
        "_limit",
        "_on_final",
        "_send",
        "_size",
        "_trailers",
        "_waiter",
        "body_done",
        "client_gone",
        "finished",
        "started",
        "status",
    )

    def __init__(self, send: Send, on_final: OnFinal, *, excluded: Container[bytes], limit: int) -> None:
        self._send = send
        self._on_final = on_final
        self._excluded = excluded
        self._limit = limit
        self._chunks: list[bytes] | None = []
        self._size = 0
        self._headers: Pairs = []
        self._trailers: Pairs | None = None  # a list once the app announced trailers
        self.status = 0
        self.started = False
        self.body_done = False
        self.finished = False
        self.client_gone = False
        self._waiter: anyio.Event | None = None

    async def wait_finished(self) -> None:
        """Return once the app has sent its last message, or `wake()` was called."""
        if self.finished:
            return
        if self._waiter is None:
            self._waiter = anyio.Event()
        await self._waiter.wait()

    def wake(self) -> None:
        """Release every `wait_finished()` caller (the answer is complete, or the app returned)."""
        if self._waiter is not None:
            self._waiter.set()

    async def _forward(self, message: Message) -> None:
        # A send that raises OSError means the client hung up (uvicorn raises ClientDisconnected, an
        # OSError): the app goes on and its answer is still recorded, as the contract requires.
        if not self.client_gone:
            try:
                await self._send(message)
            except OSError:
                self.client_gone = True

    async def __call__(self, message: Message) -> None:
        kind = message["type"]
        if kind == "http.response.body" and self.started and not self.body_done:
            body = message.get("body", b"")
            if self._chunks is not None and body:
                self._size += len(body)
                if self._size > self._limit:
                    self._chunks = None
                else:
                    self._chunks.append(body)
            if message.get("more_body", False):
                await self._forward(message)
                return
            self.body_done = True
            if self._trailers is None:
                await self._finish(message)
            else:
                await self._forward(message)
            return
        if kind == "http.response.trailers" and self.body_done and self._trailers is not None and not self.finished:
            self._trailers += _pairs(message.get("headers", ()), self._excluded)
            if message.get("more_trailers", False):
                await self._forward(message)
            else:
                await self._finish(message)
            return
        if kind == "http.response.start" and not self.started:
            self.started = True
            self.status = message["status"]
            self._headers = _pairs(message.get("headers", ()), self._excluded)
            if message.get("trailers", False):
                self._trailers = []
        await self._forward(message)

    async def _finish(self, last: Message) -> None:
        """The answer is complete: store it, then send its last message."""
        self.finished = True
        if self._chunks is None:
            response = StoredResponse(self.status, self._headers, b"", replayable=False, trailers=self._trailers)
        else:
            chunks = self._chunks
            body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
            response = StoredResponse(self.status, self._headers, body, trailers=self._trailers)
        try:
            await self._on_final(response)
            await self._forward(last)
        finally:
            self.wake()
