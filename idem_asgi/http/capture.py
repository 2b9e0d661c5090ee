"""Per-request send (and receive) wrapper: streams the answer to the client while recording it verbatim.

Every message but the last goes to the client as soon as the app sends it. The last one (the
final body chunk, or the final trailers message when the app announced trailers) is held just
long enough to write the completion, so a client that has the whole answer and retries always
finds it stored. The client hanging up never stops the recording: its `http.disconnect` reaches
the app only once the answer is complete (`receive`).

Forwarding is written out inline on the hot path (a helper coroutine per message costs more than
the rest of the message's handling).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Container

import anyio

from .._types import Message, Receive, Send
from ..records import StoredResponse

OnFinal = Callable[[StoredResponse], Awaitable[object]]
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


_IDLE, _STARTED, _BODY_DONE, _FINISHED = 0, 1, 2, 3  # where the answer is


class Capture:
    """The `send` (and `receive`) the app sees on a protected request."""

    __slots__ = (
        "_body",
        "_chunks",
        "_excluded",
        "_gone",
        "_handed",
        "_headers",
        "_limit",
        "_on_final",
        "_receive",
        "_send",
        "_size",
        "_state",
        "_trailers",
        "_waiter",
        "client_gone",
        "status",
    )

    def __init__(
        self,
        send: Send,
        receive: Receive,
        body: list[bytes],
        on_final: OnFinal,
        excluded: Container[bytes],
        limit: int,
    ) -> None:
        self._send = send
        self._receive = receive
        self._body: list[bytes] | None = body  # the request body's chunks, handed to the app once, then None
        self._handed = 0  # how many of them
        self._gone = False
        self._on_final = on_final
        self._excluded = excluded
        self._limit = limit
        self._chunks: list[bytes] | None = []
        self._size = 0
        self._headers: Pairs = []
        self._trailers: Pairs | None = None  # a list once the app announced trailers
        self._state = _IDLE
        self._waiter: anyio.Event | None = None
        self.status = 0
        self.client_gone = False

    @property
    def started(self) -> bool:
        """The app sent its `http.response.start`."""
        return self._state != _IDLE

    @property
    def finished(self) -> bool:
        """The app sent its last message (and the completion was attempted)."""
        return self._state == _FINISHED

    async def receive(self) -> Message:
        """The buffered body (its chunks, in order) once, then the real channel; a disconnect only once
        the answer is complete.

        The contract says a client that hangs up does not stop the operation: apps that stop at a
        disconnect (Starlette's `StreamingResponse` under ASGI < 2.4 cancels its stream) would
        otherwise return with half an answer.
        """
        chunks = self._body
        if chunks is not None:
            i = self._handed
            self._handed = i + 1
            more = self._handed < len(chunks)
            if not more:
                self._body = None
            return {"type": "http.request", "body": chunks[i] if chunks else b"", "more_body": more}
        if not self._gone:
            message = await self._receive()
            if message["type"] != "http.disconnect":
                return message
            self._gone = True
        await self.wait_finished()
        return {"type": "http.disconnect"}

    async def wait_finished(self) -> None:
        """Return once the app has sent its last message, or `wake()` was called."""
        if self._state == _FINISHED:
            return
        if self._waiter is None:
            self._waiter = anyio.Event()
        await self._waiter.wait()

    def wake(self) -> None:
        """Release every `wait_finished()` caller (the answer is complete, or the app returned)."""
        if self._waiter is not None:
            self._waiter.set()

    async def __call__(self, message: Message) -> None:
        # A send that raises OSError means the client hung up (uvicorn raises ClientDisconnected, an
        # OSError): the app goes on and its answer is still recorded, as the contract requires.
        kind = message["type"]
        state = self._state
        if kind == "http.response.body":
            if state == _STARTED:
                body = message.get("body", b"")
                chunks = self._chunks
                if chunks is not None and body:
                    self._size += len(body)
                    if self._size > self._limit:
                        self._chunks = None
                    else:
                        chunks.append(body)
                if not message.get("more_body", False):
                    if self._trailers is None:
                        await self._finish(message)
                        return
                    self._state = _BODY_DONE
        elif kind == "http.response.start":
            if state == _IDLE:
                self._state = _STARTED
                self.status = message["status"]
                self._headers = _pairs(message.get("headers", ()), self._excluded)
                if message.get("trailers", False):
                    self._trailers = []
        elif kind == "http.response.trailers" and state == _BODY_DONE and self._trailers is not None:
            self._trailers += _pairs(message.get("headers", ()), self._excluded)
            if not message.get("more_trailers", False):
                await self._finish(message)
                return
        if not self.client_gone:
            try:
                await self._send(message)
            except OSError:
                self.client_gone = True

    async def _finish(self, last: Message) -> None:
        """The answer is complete: store it, then send its last message."""
        self._state = _FINISHED
        chunks = self._chunks
        if chunks is None:
            response = StoredResponse(self.status, self._headers, b"", False, self._trailers)
        else:
            body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
            response = StoredResponse(self.status, self._headers, body, True, self._trailers)
        try:
            await self._on_final(response)
            if not self.client_gone:
                try:
                    await self._send(last)
                except OSError:
                    self.client_gone = True
        finally:
            if self._waiter is not None:
                self._waiter.set()
