"""A minimal asyncio HTTP/1.1 client for load generation (httpx is too slow to measure a server with).

Raw asyncio streams, pre-built request bytes, keep-alive connections, Content-Length and chunked
responses. `run_load` drives a fixed number of connections, each sending its next request as soon
as the previous answer is in, and stops at a request count *or* a time limit, whichever comes first;
a hard deadline (duration + timeout) cancels anything still hanging. Only meant for 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

__all__ = [
    "Connection",
    "LoadResult",
    "Response",
    "build_request",
    "fetch",
    "percentile",
    "run_load",
]


class ProtocolError(Exception):
    """The server sent something this client does not understand."""


@dataclass(slots=True)
class Response:
    """One HTTP answer: status, header pairs (names lower-cased) and the whole body."""

    status: int
    headers: list[tuple[bytes, bytes]]
    body: bytes
    close: bool = False

    def header(self, name: str) -> bytes | None:
        raw = name.lower().encode("latin-1")
        for k, v in self.headers:
            if k == raw:
                return v
        return None


def build_request(
    method: str,
    path: str,
    *,
    headers: Sequence[tuple[str, str]] = (),
    body: bytes = b"",
    host: str = "127.0.0.1",
    close: bool = False,
) -> bytes:
    """The bytes of one HTTP/1.1 request (Content-Length framed)."""
    lines = [f"{method} {path} HTTP/1.1", f"host: {host}"]
    lines += [f"{k}: {v}" for k, v in headers]
    if body or method in ("POST", "PUT", "PATCH"):
        lines.append(f"content-length: {len(body)}")
    if close:
        lines.append("connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


async def _read_response(reader: asyncio.StreamReader) -> Response:
    head = await reader.readuntil(b"\r\n\r\n")
    lines = head[:-4].split(b"\r\n")
    status_line = lines[0]
    if not status_line.startswith(b"HTTP/1."):
        raise ProtocolError(f"bad status line {status_line[:80]!r}")
    status = int(status_line[9:12])
    headers: list[tuple[bytes, bytes]] = []
    length = -1
    chunked = False
    close = status_line.startswith(b"HTTP/1.0")
    for line in lines[1:]:
        name, _, value = line.partition(b":")
        name = name.strip().lower()
        value = value.strip()
        headers.append((name, value))
        if name == b"content-length":
            length = int(value)
        elif name == b"transfer-encoding":
            chunked = b"chunked" in value.lower()
        elif name == b"connection":
            close = value.lower() == b"close"
    if chunked:
        parts: list[bytes] = []
        while True:
            size_line = await reader.readuntil(b"\r\n")
            size = int(size_line.split(b";", 1)[0].strip(), 16)
            if size == 0:
                # trailers (if any) end with an empty line
                while (await reader.readuntil(b"\r\n")) != b"\r\n":
                    pass
                break
            chunk = await reader.readexactly(size + 2)
            parts.append(chunk[:-2])
        body = b"".join(parts)
    elif length >= 0:
        body = await reader.readexactly(length) if length else b""
    elif status in (204, 304) or 100 <= status < 200:
        body = b""
    else:  # no framing: the body runs to the end of the connection
        body = await reader.read()
        close = True
    return Response(status, headers, body, close)


class Connection:
    """One keep-alive HTTP/1.1 connection; requests on it are sequential."""

    __slots__ = ("_reader", "_writer", "closed")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        self.closed = False

    @classmethod
    async def open(cls, host: str, port: int) -> Connection:
        reader, writer = await asyncio.open_connection(host, port)
        return cls(reader, writer)

    async def request(self, raw: bytes) -> Response:
        """Send pre-built request bytes and read the whole answer."""
        self._writer.write(raw)
        if len(raw) > 65536:
            await self._writer.drain()
        response = await _read_response(self._reader)
        if response.close:
            await self.close()
        return response

    async def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._writer.close()
        with contextlib.suppress(OSError):
            await self._writer.wait_closed()


async def fetch(host: str, port: int, raw: bytes, *, timeout: float = 10.0) -> Response:
    """One request on a fresh connection (closed afterwards), bounded by `timeout` seconds."""

    async def go() -> Response:
        conn = await Connection.open(host, port)
        try:
            return await conn.request(raw)
        finally:
            await conn.close()

    return await asyncio.wait_for(go(), timeout)


def percentile(values: Sequence[float], p: float) -> float:
    """Nearest-rank percentile of `values` (p in 0..100); NaN when empty."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, round(p / 100 * len(ordered) + 0.5) - 1))
    return ordered[rank]


@dataclass
class LoadResult:
    """What one load run saw: completed requests, wall time, per-request latency and status."""

    requests: int = 0
    elapsed: float = 0.0
    latencies: list[float] = field(default_factory=list)
    statuses: Counter[int] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    timed_out: bool = False

    @property
    def rps(self) -> float:
        return self.requests / self.elapsed if self.elapsed > 0 else 0.0

    def p(self, q: float) -> float:
        """Latency percentile in milliseconds."""
        return percentile(self.latencies, q) * 1000


async def run_load(
    host: str,
    port: int,
    request_for: Callable[[int], bytes],
    *,
    concurrency: int,
    max_requests: int,
    duration: float,
    timeout: float = 10.0,
    max_errors: int = 100,
) -> LoadResult:
    """Send up to `max_requests` requests (request `i` is `request_for(i)`) for at most `duration` s.

    `concurrency` keep-alive connections each run one request at a time. A connection the server
    closes is reopened. Everything is cancelled at `duration + timeout` s, so nothing can hang.
    """
    result = LoadResult()
    latencies = result.latencies
    statuses = result.statuses
    errors = result.errors
    counter = 0
    perf = time.perf_counter
    start = perf()
    stop_at = start + duration

    async def worker() -> None:
        nonlocal counter
        conn: Connection | None = None
        try:
            while counter < max_requests and perf() < stop_at and sum(errors.values()) < max_errors:
                i = counter
                counter += 1
                raw = request_for(i)
                if conn is None or conn.closed:
                    conn = await Connection.open(host, port)
                t0 = perf()
                try:
                    response = await conn.request(raw)
                except (OSError, asyncio.IncompleteReadError, ProtocolError, ValueError) as exc:
                    errors[type(exc).__name__] += 1
                    await conn.close()
                    conn = None
                    continue
                latencies.append(perf() - t0)
                statuses[response.status] += 1
        finally:
            if conn is not None:
                await conn.close()

    tasks = [asyncio.ensure_future(worker()) for _ in range(concurrency)]
    try:
        done, pending = await asyncio.wait(tasks, timeout=duration + timeout)
        for t in pending:
            t.cancel()
        if pending:
            result.timed_out = True
            await asyncio.gather(*pending, return_exceptions=True)
        for t in done:
            exc = t.exception()
            if exc is not None:
                errors[type(exc).__name__] += 1
    finally:
        for t in tasks:
            t.cancel()
    result.elapsed = perf() - start
    result.requests = len(latencies)
    return result
