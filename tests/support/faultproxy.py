"""A tiny HTTP/1.1 TCP proxy on loopback that can lose responses, for testing clients against real faults.

It understands just enough HTTP/1.1 (Content-Length and chunked bodies, keep-alive) to know where
one message ends. Requests are numbered 1, 2, 3, ... across all connections in arrival order.

- pass-through: every request is forwarded and its response sent back.
- `lose={n}`: request n is forwarded, its full response read from upstream, and then the client's
  connection is closed without sending it: the server did the work, the answer never arrived.
- `hang={n}`: request n is held (never forwarded, never answered) until the proxy stops.

`StoreProxy` (below) is the byte-level counterpart for the middleware's STORE connections (Redis
RESP, PostgreSQL wire protocol): delay, blackhole, reset, and losing the reply to one chosen command.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct
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


# -- byte-level store proxy ------------------------------------------------------------------
#
# `StoreProxy` sits between a store client (redis-py, asyncpg) and the store, on 127.0.0.1. It
# frames the client's stream into units (a RESP command; a PostgreSQL frontend message) and the
# store's stream into replies, pairs them up in order (both protocols answer in request order on
# one connection), and can lose exactly the reply it is told to:
#
# - `delay(s)`: every reply waits `s` seconds before it is forwarded.
# - `blackhole()` ... `restore()`: nothing is forwarded either way (a partitioned host); on
#   `restore()` the connections that lost bytes are reset (their protocol state is unknown).
# - `reset_all()`: every open connection is reset now (RST), as by a crashed middlebox.
# - `fault(match, action=..., nth=1, count=1)`: the `nth` .. `nth + count - 1`-th unit matching
#   `match` (counted from this call) gets `action`:
#     * "drop_reply": forwarded; the store runs it; its reply is swallowed and the connection
#       stays open and silent (the client waits until its own timeout);
#     * "drop_reply_reset": the same, then the connection is reset once the whole reply has
#       been swallowed (the store did the work, the client sees a reset);
#     * "reset_before": the connection is reset instead of forwarding the unit (a lost request);
#     * "reset_after_forward": the unit alone is forwarded, then the connection is reset at once
#       (for PostgreSQL an Execute without its Sync: the server rolls the statement back).
#
# For PostgreSQL a "reply" is everything the server sends up to the ReadyForQuery that answers a
# Sync or a simple Query, so "drop_reply" on an Execute forwards its Sync too: the server commits,
# and the answer is lost. Units that match are `Unit(kind, args, sql)`: for RESP `kind` is the
# upper-cased command name and `args` its arguments; for PostgreSQL `kind` is the message type
# letter ("E" Execute, "Q" Query, "P" Parse, ...) and `sql` the statement it runs (via Bind/Parse).

_MAX_BUFFER = 64 * 1024 * 1024
_MAX_CONNECTIONS = 1_000
_PG_SSL, _PG_GSS, _PG_CANCEL = 80877103, 80877104, 80877102
_ACTIONS = ("drop_reply", "drop_reply_reset", "reset_before", "reset_after_forward")


class Unit:
    """One client unit as the proxy framed it (a RESP command, a PostgreSQL message).

    For a PostgreSQL Execute, `params` is the raw payload of the Bind that made its portal (the
    parameter values are in it verbatim, so a rule can pick one key's statements).
    """

    __slots__ = ("args", "kind", "params", "sql")

    def __init__(self, kind: str, args: tuple[bytes, ...] = (), sql: str = "", params: bytes = b"") -> None:
        self.kind = kind
        self.args = args
        self.sql = sql
        self.params = params

    def __repr__(self) -> str:
        return f"Unit({self.kind!r}, args={len(self.args)}, sql={self.sql[:40]!r})"


class _Rule:
    __slots__ = ("action", "count", "hits", "match", "nth")

    def __init__(self, match: Any, action: str, nth: int, count: int) -> None:
        if action not in _ACTIONS:
            raise ValueError(f"unknown action {action!r}")
        self.match = match
        self.action = action
        self.nth = nth
        self.count = count
        self.hits = 0

    def applies(self, unit: Unit) -> bool:
        if not self.match(unit):
            return False
        self.hits += 1
        return self.nth <= self.hits < self.nth + self.count

    @property
    def applied(self) -> int:
        return max(0, min(self.hits - self.nth + 1, self.count))


class _Group:
    """What one reply answers: a RESP command, or the PostgreSQL messages up to a Sync/Query."""

    __slots__ = ("action", "closed")

    def __init__(self) -> None:
        self.action: str | None = None
        self.closed = False


def evalsha_of(script: str, key: str | None = None) -> Any:
    """Match the EVALSHA (or EVAL) of one Lua script, by its SHA1 as redis-py sends it; with `key`,
    only when its first KEYS argument is that Redis key."""
    import hashlib

    sha = hashlib.sha1(script.encode()).hexdigest().encode()
    name = None if key is None else key.encode()

    def match(unit: Unit) -> bool:
        if unit.kind == "EVALSHA":
            ok = bool(unit.args) and unit.args[0].lower() == sha
        else:
            ok = unit.kind == "EVAL" and bool(unit.args) and unit.args[0] == script.encode()
        return ok and (name is None or (len(unit.args) > 2 and unit.args[2] == name))

    return match


def pg_execute(*fragments: str, param: bytes | None = None) -> Any:
    """Match a PostgreSQL Execute (or simple Query) whose statement contains every fragment; with
    `param`, only when those bytes are among its bound parameter values."""

    def match(unit: Unit) -> bool:
        if unit.kind not in ("E", "Q") or not all(f in unit.sql for f in fragments):
            return False
        return param is None or param in unit.params

    return match


class _Stop(Exception):
    """Reset this proxied connection now."""


class StoreProxy:
    """A fault-injecting TCP proxy for a store on 127.0.0.1 (`protocol`: "resp", "pg" or "raw")."""

    def __init__(self, upstream_port: int, *, protocol: str = "raw") -> None:
        if protocol not in ("resp", "pg", "raw"):
            raise ValueError(f"unknown protocol {protocol!r}")
        self.upstream_port = upstream_port
        self.protocol = protocol
        self.port = 0
        self.connections = 0
        self.dropped_replies = 0
        self.resets = 0
        self.units = 0
        self._delay = 0.0
        self._blackhole = False
        self._rules: list[_Rule] = []
        self._server: asyncio.Server | None = None
        self._conns: set[_Conn] = set()
        self._tasks: set[asyncio.Task[Any]] = set()

    # -- controls --------------------------------------------------------------------------

    def pass_through(self) -> None:
        """No delay, no blackhole, no pending rules."""
        self._delay = 0.0
        self._blackhole = False
        self._rules = []

    def delay(self, seconds: float) -> None:
        self._delay = seconds

    def blackhole(self) -> None:
        self._blackhole = True

    def restore(self) -> int:
        """End a blackhole; reset the connections that lost bytes in it. Returns how many."""
        self._blackhole = False
        poisoned = [c for c in self._conns if c.poisoned]
        for conn in poisoned:
            conn.reset()
        return len(poisoned)

    def reset_all(self) -> int:
        conns = list(self._conns)
        for conn in conns:
            conn.reset()
        return len(conns)

    def fault(self, match: Any, *, action: str = "drop_reply", nth: int = 1, count: int = 1) -> None:
        """Apply `action` to the nth .. nth+count-1-th unit matching `match`, counted from now."""
        self._rules.append(_Rule(match, action, nth, count))

    def hits(self) -> int:
        """How many units matched the rules set since the last `pass_through()`."""
        return sum(r.hits for r in self._rules)

    def applied(self) -> int:
        """How many units got their rule's action since the last `pass_through()`."""
        return sum(r.applied for r in self._rules)

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self) -> None:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
        for conn in list(self._conns):
            conn.reset()
        if self._tasks:  # an aborted connection ends its pumps; cancel only what hangs on
            await asyncio.wait(set(self._tasks), timeout=2)
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=5)
        if self._server is not None:
            await asyncio.wait_for(self._server.wait_closed(), timeout=5)

    async def __aenter__(self) -> StoreProxy:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def _decide(self, unit: Unit) -> str | None:
        self.units += 1
        action = None
        for rule in self._rules:
            if rule.applies(unit) and action is None:
                action = rule.action
        return action

    async def _accept(self, creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        if len(self._conns) >= _MAX_CONNECTIONS:
            cwriter.close()
            return
        self._tasks.add(task)
        self.connections += 1
        conn = _Conn(self, creader, cwriter)
        self._conns.add(conn)
        try:
            await conn.run()
        finally:
            self._conns.discard(conn)
            self._tasks.discard(task)


class _Conn:
    """One proxied connection: two pumps sharing the FIFO of groups awaiting their reply."""

    def __init__(self, proxy: StoreProxy, creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter) -> None:
        self.proxy = proxy
        self.creader = creader
        self.cwriter = cwriter
        self.uwriter: asyncio.StreamWriter | None = None
        self.poisoned = False
        self.closed = False
        self.pending: list[_Group] = []  # FIFO: groups whose reply has not fully arrived
        self.open_group: _Group | None = None
        # PostgreSQL framing state
        self.pg_startup = True  # untyped messages until the StartupMessage
        self.pg_one_byte = asyncio.Queue[bool]()  # server owes a 1-byte SSL/GSS answer
        self.pg_raw = False  # TLS or a cancel request: stop framing
        self.statements: dict[bytes, str] = {}
        self.portals: dict[bytes, tuple[str, bytes]] = {}

    def reset(self) -> None:
        """Close both sides at once; the client side with RST (SO_LINGER 0)."""
        if self.closed:
            return
        self.closed = True
        self.proxy.resets += 1
        with contextlib.suppress(OSError, AttributeError):
            sock = self.cwriter.get_extra_info("socket")
            if sock is not None:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.cwriter.transport.abort()
        if self.uwriter is not None:
            self.uwriter.transport.abort()

    async def run(self) -> None:
        try:
            if self.proxy._blackhole:
                self.poisoned = True
                await self._discard(self.creader)
                return
            ureader, self.uwriter = await asyncio.open_connection("127.0.0.1", self.proxy.upstream_port)
            up = asyncio.ensure_future(self._client_to_store())
            down = asyncio.ensure_future(self._store_to_client(ureader))
            try:
                await asyncio.wait({up, down}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for t in (up, down):
                    t.cancel()
                await asyncio.gather(up, down, return_exceptions=True)
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            # Also after reset(): the upstream connection may have been opened after it ran.
            self.closed = True
            for w in (self.cwriter, self.uwriter):
                if w is not None and not w.transport.is_closing():
                    w.close()
            for w in (self.cwriter, self.uwriter):
                if w is not None:
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(w.wait_closed(), 1)

    async def _discard(self, reader: asyncio.StreamReader) -> None:
        while not self.closed and await reader.read(65536):
            pass

    # -- client -> store -------------------------------------------------------------------

    async def _client_to_store(self) -> None:
        buf = bytearray()
        assert self.uwriter is not None
        while not self.closed:
            data = await self.creader.read(65536)
            if not data:
                return
            if self.proxy._blackhole:
                self.poisoned = True
                continue
            if self.proxy.protocol == "raw" or self.pg_raw:
                self.uwriter.write(data)
                await self.uwriter.drain()
                continue
            buf += data
            if len(buf) > _MAX_BUFFER:
                raise OSError("client unit too large")
            out = bytearray()
            try:
                while True:
                    framed = self._frame_client(buf)
                    if framed is None:
                        break
                    size, unit, ends_group = framed
                    raw = bytes(buf[:size])
                    del buf[:size]
                    action = self.proxy._decide(unit) if unit is not None else None
                    if action == "reset_before":
                        self.uwriter.write(bytes(out))
                        await self.uwriter.drain()
                        raise _Stop
                    group = self._group_for(unit)
                    if action in ("drop_reply", "drop_reply_reset") and group is not None:
                        group.action = action
                    out += raw
                    if action == "reset_after_forward":
                        self.uwriter.write(bytes(out))
                        await self.uwriter.drain()
                        raise _Stop
                    if ends_group and group is not None:
                        group.closed = True
                        self.open_group = None
                    if self.pg_raw:
                        out += buf
                        buf.clear()
                        break
            except _Stop:
                self.reset()
                return
            if out:
                self.uwriter.write(bytes(out))
                await self.uwriter.drain()

    def _group_for(self, unit: Unit | None) -> _Group | None:
        if unit is None:
            return None
        if self.open_group is None:
            self.open_group = _Group()
            self.pending.append(self.open_group)
        return self.open_group

    def _frame_client(self, buf: bytearray) -> tuple[int, Unit | None, bool] | None:
        """(bytes, unit, ends its group) for the first whole unit in `buf`, or None."""
        if self.proxy.protocol == "resp":
            parsed = _resp_value(buf, 0)
            if parsed is None:
                return None
            value, end = parsed
            if isinstance(value, list) and value and all(isinstance(v, bytes) for v in value):
                return end, Unit(value[0].decode("latin-1").upper(), tuple(value[1:])), True
            if isinstance(value, bytes):  # an inline command
                words = value.split()
                return end, Unit(words[0].decode("latin-1").upper() if words else "", tuple(words[1:])), True
            return end, Unit("?"), True
        if self.pg_startup:
            if len(buf) < 8:
                return None
            length, code = struct.unpack_from("!ii", buf, 0)
            if length < 8 or len(buf) < length:
                return None if length >= 8 else (len(buf), None, False)
            if code in (_PG_SSL, _PG_GSS):
                self.pg_one_byte.put_nowait(True)
                return length, None, False
            if code == _PG_CANCEL:
                self.pg_raw = True
                return length, None, False
            self.pg_startup = False
            return length, Unit("startup"), True
        if len(buf) < 5:
            return None
        kind = chr(buf[0])
        (length,) = struct.unpack_from("!i", buf, 1)
        if len(buf) < length + 1:
            return None
        payload = bytes(buf[5 : length + 1])
        sql = ""
        params = b""
        if kind == "P":
            name, _, rest = payload.partition(b"\0")
            sql = rest.partition(b"\0")[0].decode("utf-8", "replace")
            self.statements[name] = sql
        elif kind == "B":
            portal, _, rest = payload.partition(b"\0")
            statement = rest.partition(b"\0")[0]
            sql = self.statements.get(statement, "")
            self.portals[portal] = (sql, payload)
        elif kind == "E":
            sql, params = self.portals.get(payload.partition(b"\0")[0], ("", b""))
        elif kind == "Q":
            sql = payload.partition(b"\0")[0].decode("utf-8", "replace")
        elif kind == "C" and payload[:1] == b"S":  # Close statement
            self.statements.pop(payload[1:].partition(b"\0")[0], None)
        if kind == "X":
            return length + 1, None, False
        return length + 1, Unit(kind, sql=sql, params=params), kind in ("S", "Q")

    # -- store -> client -------------------------------------------------------------------

    async def _store_to_client(self, ureader: asyncio.StreamReader) -> None:
        buf = bytearray()
        while not self.closed:
            data = await ureader.read(65536)
            if not data:
                return
            if self.proxy._blackhole:
                self.poisoned = True
                continue
            if self.proxy._delay:
                await asyncio.sleep(self.proxy._delay)
            if self.proxy.protocol == "raw" or self.pg_raw:
                self.cwriter.write(data)
                await self.cwriter.drain()
                continue
            buf += data
            if len(buf) > _MAX_BUFFER:
                raise OSError("store reply too large")
            out = bytearray()
            reset = False
            while True:
                framed = self._frame_store(buf)
                if framed is None:
                    break
                size, ends_reply = framed
                raw = bytes(buf[:size])
                del buf[:size]
                head = self.pending[0] if self.pending else None
                if head is not None and head.action is not None:
                    if ends_reply:
                        self.pending.pop(0)
                        self.proxy.dropped_replies += 1
                        if head.action == "drop_reply_reset":
                            reset = True
                            break
                    continue  # swallowed
                out += raw
                if ends_reply and head is not None:
                    self.pending.pop(0)
                if self.pg_raw:
                    out += buf
                    buf.clear()
                    break
            if out:
                self.cwriter.write(bytes(out))
                await self.cwriter.drain()
            if reset:
                self.reset()
                return

    def _frame_store(self, buf: bytearray) -> tuple[int, bool] | None:
        """(bytes, ends a reply) for the first whole store message in `buf`, or None."""
        if self.proxy.protocol == "resp":
            offset = 0
            while True:  # RESP3 attributes (|) prefix the reply they annotate
                parsed = _resp_value(buf, offset)
                if parsed is None:
                    return None
                value, offset = parsed
                if not isinstance(value, _Attribute):
                    break
            return offset, not isinstance(value, _Push)
        if not self.pg_one_byte.empty():
            self.pg_one_byte.get_nowait()
            if buf[:1] != b"N":
                self.pg_raw = True  # TLS or GSS encryption: nothing left to frame
            return 1, False
        if len(buf) < 5:
            return None
        (length,) = struct.unpack_from("!i", buf, 1)
        if len(buf) < length + 1:
            return None
        return length + 1, buf[0:1] == b"Z"


class _Attribute(list):  # type: ignore[type-arg]
    pass


class _Push(list):  # type: ignore[type-arg]
    pass


def _resp_line(buf: bytearray, pos: int) -> tuple[bytes, int] | None:
    end = buf.find(b"\r\n", pos)
    if end < 0:
        return None
    return bytes(buf[pos:end]), end + 2


def _resp_value(buf: bytearray, pos: int, depth: int = 0) -> tuple[Any, int] | None:
    """One RESP2/RESP3 value starting at `pos`: (value, end) or None when incomplete."""
    if depth > 32:
        raise ValueError("RESP nesting too deep")
    if pos >= len(buf):
        return None
    line = _resp_line(buf, pos + 1)
    if line is None:
        return None
    head, after = line
    kind = bytes(buf[pos : pos + 1])
    if kind in (b"+", b"-", b":", b"_", b",", b"#", b"("):
        return head, after
    if kind in (b"$", b"!", b"="):
        size = int(head)
        if size < 0:
            return None, after
        if len(buf) < after + size + 2:
            return None
        return bytes(buf[after : after + size]), after + size + 2
    if kind in (b"*", b"~", b">", b"%", b"|"):
        count = int(head)
        if count < 0:
            return None, after
        if kind in (b"%", b"|"):
            count *= 2
        items: list[Any] = _Attribute() if kind == b"|" else _Push() if kind == b">" else []
        for _ in range(count):
            parsed = _resp_value(buf, after, depth + 1)
            if parsed is None:
                return None
            value, after = parsed
            items.append(value)
        return items, after
    # An inline command (client side only): one line of words.
    end = buf.find(b"\r\n", pos)
    if end < 0:
        return None
    return bytes(buf[pos:end]), end + 2
