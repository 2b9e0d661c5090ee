"""A tiny HTTP/1.1 TCP proxy on loopback that can lose responses, for testing clients against real faults.

It understands just enough HTTP/1.1 (Content-Length and chunked bodies, keep-alive) to know where
one message ends. Requests are numbered 1, 2, 3, ... across all connections in arrival order.

- pass-through: every request is forwarded and its response sent back.
- `lose={n}`: request n is forwarded, its full response read from upstream, and then the client's
  connection is closed without sending it: the server did the work, the answer never arrived.
- `hang={n}`: request n is held (never forwarded, never answered) until the proxy stops.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterable
from typing import Any

_MAX_HEAD = 64 * 1024
_MAX_CHUNKS = 100_000
_MAX_REQUESTS_PER_CONNECTION = 10_000


class FaultProxy:
    """Forwards 127.0.0.1:<port> to an upstream, losing or holding the requests it is told to."""

    def __init__(self, upstream_port: int, *, lose: Iterable[int] = (), hang: Iterable[int] = ()) -> None:
        self.upstream_port = upstream_port
        self.lose = set(lose)
        self.hang = set(hang)
        self.requests = 0
        self.lost = 0
        self.port = 0
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._writers: set[asyncio.StreamWriter] = set()
        self._stopping = asyncio.Event()

    def set_faults(self, *, lose: Iterable[int] = (), hang: Iterable[int] = ()) -> None:
        """New faults, numbered from the next request on (1 is the next one)."""
        self.lose = {self.requests + n for n in lose}
        self.hang = {self.requests + n for n in hang}

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        """Close the listener and every connection, and wait for the handlers to end."""
        self._stopping.set()
        if self._server is not None:
            self._server.close()
        for w in list(self._writers):
            w.close()
        for t in list(self._tasks):
            t.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks, timeout=5)
        if self._server is not None:
            await asyncio.wait_for(self._server.wait_closed(), timeout=5)

    async def _accept(self, creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        self._writers.add(cwriter)
        uwriter: asyncio.StreamWriter | None = None
        try:
            ureader, uwriter = await asyncio.open_connection("127.0.0.1", self.upstream_port)
            self._writers.add(uwriter)
            for _ in range(_MAX_REQUESTS_PER_CONNECTION):
                request = await _read_message(creader)
                if request is None:
                    return
                self.requests += 1
                n = self.requests
                if n in self.hang:
                    await self._stopping.wait()
                    return
                uwriter.write(request)
                await uwriter.drain()
                response = await _read_message(ureader)
                if response is None:
                    return
                if n in self.lose:
                    self.lost += 1
                    return  # the finally closes the client connection: the answer is lost
                cwriter.write(response)
                await cwriter.drain()
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError):
            return
        finally:
            for w in (cwriter, uwriter):
                if w is not None:
                    self._writers.discard(w)
                    w.close()
                    with contextlib.suppress(Exception):
                        await w.wait_closed()
            self._tasks.discard(task)


async def _read_message(reader: asyncio.StreamReader) -> bytes | None:
    """One whole HTTP/1.1 message as raw bytes, or None at a clean end of stream."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError as exc:
        if not exc.partial:
            return None
        raise
    if len(head) > _MAX_HEAD:
        raise ValueError("head too large")
    lines = head[:-4].split(b"\r\n")
    length = 0
    chunked = False
    is_response = lines[0].startswith(b"HTTP/")
    close_delimited = is_response
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        if name == b"content-length":
            length = int(value.strip())
            close_delimited = False
        elif name == b"transfer-encoding" and b"chunked" in value.lower():
            chunked = True
            close_delimited = False
    if is_response:
        status = int(lines[0].split(b" ")[1])
        if status in (204, 304) or 100 <= status < 200:
            return head
    if chunked:
        parts = [head]
        for _ in range(_MAX_CHUNKS):
            size_line = await reader.readuntil(b"\r\n")
            parts.append(size_line)
            size = int(size_line.split(b";")[0].strip(), 16)
            if size == 0:
                for _ in range(_MAX_CHUNKS):  # trailers, then the empty line
                    line = await reader.readuntil(b"\r\n")
                    parts.append(line)
                    if line == b"\r\n":
                        return b"".join(parts)
                raise ValueError("too many trailers")
            parts.append(await reader.readexactly(size + 2))
        raise ValueError("too many chunks")
    if close_delimited:
        return head + await reader.read()
    return head + await reader.readexactly(length)
