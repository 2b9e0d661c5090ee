"""A lean RESP2 connection pool for `RedisBackend`'s hot script calls (hiredis required).

redis-py spends most of a call's client-side CPU in its pool, connection and command layers; the
backend sends one small EVALSHA per operation and needs none of that. Here a call takes an idle
connection (an `asyncio.Protocol`), packs its command (`hiredis.pack_command`), writes it and
awaits a future; `hiredis.Reader` parses replies in `data_received` and resolves the futures in
FIFO order. Single commands (`execute`, every script call) all share one connection, written
together once per event-loop turn (auto-pipelining); a pipeline that must have a connection of
its own (`execute_many`: a write and the `WAIT` that blocks the connection behind it) takes one
from the pool, see `RespPool`.

Failure semantics follow redis-py with a socket timeout:
- connect (and AUTH, SELECT) is bounded by `connect_timeout` (redis-py's `socket_connect_timeout`);
  a refused connect is a `ConnectionError`, a slow one a `TimeoutError`; concurrent callers share
  one connect attempt;
- a call not done within `timeout` (the wait for a pooled connection, a connect and the reply
  share one deadline) fails with `TimeoutError` when the connection has also been silent for
  `timeout` (a reply still arriving, a big answer, is late, not stalled); it then aborts its
  connection (any other call pending on it fails with `TimeoutError` too: its reply is stuck behind
  the same stall). One lazy watchdog timer per connection checks the oldest call's deadline and the
  last bytes heard; no per-call timer and no `wait_for`;
- a call on the shared connection whose caller is cancelled leaves it be (its reply is read and
  dropped); an `execute_many` whose caller is cancelled aborts its connection (as redis-py does);
  a caller cancelled while it waits for a pooled connection gets its `CancelledError`, never a
  timeout;
- a lost connection fails every pending call with `ConnectionError`; the next call reconnects;
- error replies are redis-py's exception classes (`NoScriptError`, `ResponseError`, ...).
Retrying is the caller's business (`RedisBackend._call` retries once on `ConnectionError`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
from typing import Any
from urllib.parse import urlparse

import hiredis
from redis import exceptions as redis_errors

from ._replies import error as _error
from ._url import Address, lean_settings


def _pack(args: tuple[Any, ...]) -> bytes:
    packed: bytes = hiredis.pack_command(args)
    return packed


class _Protocol(asyncio.Protocol):
    """One connection: a FIFO of (future, deadline) for the calls written and not yet answered."""

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self.loop = asyncio.get_running_loop()
        self.reader = hiredis.Reader()
        self.pending: collections.deque[tuple[asyncio.Future[Any], float]] = collections.deque()
        self.transport: Any = None  # asyncio.Transport, or uvloop's (not a subclass)
        self.closed = False
        self.lost: asyncio.Future[None] = self.loop.create_future()
        self.timer: asyncio.TimerHandle | None = None
        self.queued: list[bytes] = []  # commands of this turn, not yet written (see `queue`)
        self.heard = float("-inf")  # when bytes last arrived

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport
        if self.closed:  # aborted before uvloop reported the connection
            transport.abort()  # type: ignore[attr-defined]

    def send(self, packed: bytes, deadline: float | None = None) -> asyncio.Future[Any]:
        """Write one command; its reply is due by `deadline` (loop time; default `timeout` from now)."""
        fut = self.loop.create_future()
        if self.closed:  # lost between the pool handing it out and this call
            fut.set_exception(redis_errors.ConnectionError("connection lost"))
            return fut
        if deadline is None:
            deadline = self.loop.time() + self.timeout
        self.pending.append((fut, deadline))
        self.transport.write(packed)
        if self.timer is None:
            self.timer = self.loop.call_at(deadline, self._watchdog)
        return fut

    def queue(self, packed: bytes, deadline: float) -> asyncio.Future[Any]:
        """`send`, on a connection many calls share: commands queued in one event-loop turn are
        written together, in one syscall, when the turn ends (auto-pipelining)."""
        fut = self.loop.create_future()
        if self.closed:
            fut.set_exception(redis_errors.ConnectionError("connection lost"))
            return fut
        self.pending.append((fut, deadline))
        if not self.queued:
            self.loop.call_soon(self._flush)
        self.queued.append(packed)
        if self.timer is None:
            self.timer = self.loop.call_at(deadline, self._watchdog)
        return fut

    def _flush(self) -> None:
        queued, self.queued = self.queued, []
        if not self.closed and queued:
            self.transport.write(b"".join(queued))

    def send_many(self, packed: bytes, count: int, deadline: float) -> list[asyncio.Future[Any]]:
        """`count` commands packed together, written at once: one future per reply, in order."""
        futures = [self.loop.create_future() for _ in range(count)]
        if self.closed:
            for fut in futures:
                fut.set_exception(redis_errors.ConnectionError("connection lost"))
            return futures
        self.pending.extend((fut, deadline) for fut in futures)
        self.transport.write(packed)
        if self.timer is None:
            self.timer = self.loop.call_at(deadline, self._watchdog)
        return futures

    def _watchdog(self) -> None:
        self.timer = None
        if self.closed or not self.pending:
            return
        deadline = self.pending[0][1]
        now = self.loop.time()
        if deadline > now:
            self.timer = self.loop.call_at(deadline, self._watchdog)
        elif deadline - self.timeout < self.heard > now - self.timeout:
            # Late, but bytes arrived since this call was sent, and lately (replies come in order,
            # so they are this call's or finished the one before): a big reply on its way, not a
            # stalled server. Judged again once `timeout` passes in silence.
            self.timer = self.loop.call_at(self.heard + self.timeout, self._watchdog)
        else:
            self.abort(redis_errors.TimeoutError(f"no reply within {self.timeout}s"))

    def data_received(self, data: bytes) -> None:
        self.heard = self.loop.time()
        reader = self.reader
        reader.feed(data)
        pending = self.pending
        while True:
            try:
                reply = reader.gets()
            except hiredis.ProtocolError as exc:
                self.abort(redis_errors.ConnectionError(f"protocol error: {exc}"))
                return
            if reply is False:
                return
            if not pending:  # a reply nobody asked for: the stream is out of step
                self.abort(redis_errors.ConnectionError("unexpected reply"))
                return
            fut, _ = pending.popleft()
            if fut.done():  # its caller was cancelled
                continue
            if isinstance(reply, hiredis.ReplyError):
                fut.set_exception(_error(reply))
            else:
                fut.set_result(reply)

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(redis_errors.ConnectionError(f"connection lost: {exc or 'closed by server'}"))
        if not self.lost.done():
            self.lost.set_result(None)

    def abort(self, exc: Exception) -> None:
        """Fail every pending call with `exc` and drop the connection (RST)."""
        self._fail(exc)
        if self.transport is not None:
            self.transport.abort()

    def _fail(self, exc: Exception) -> None:
        self.closed = True
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        pending, self.pending = self.pending, collections.deque()
        for fut, _ in pending:
            if not fut.done():
                fut.set_exception(exc)
        # Futures failed here may have no awaiting caller left (cancelled): mark them retrieved.
        for fut, _ in pending:
            if not fut.cancelled():
                fut.exception()


class Script:
    """`await script(keys=[...], args=[...])`: EVALSHA; on NOSCRIPT, SCRIPT LOAD and EVALSHA again."""

    def __init__(self, conn: RespPool, source: str) -> None:
        self.conn = conn
        self.source = source.encode("utf-8")
        self.sha = hashlib.sha1(self.source).hexdigest()

    async def __call__(self, keys: list[Any], args: tuple[Any, ...] | list[Any] = ()) -> Any:
        try:
            return await self.conn.execute("EVALSHA", self.sha, len(keys), *keys, *args)
        except redis_errors.NoScriptError:
            self.sha = await self.conn.execute("SCRIPT", "LOAD", self.source)
            if isinstance(self.sha, bytes):
                self.sha = self.sha.decode("ascii")
            return await self.conn.execute("EVALSHA", self.sha, len(keys), *keys, *args)


class RespPool:
    """Lazily opened connections to one Redis server (TCP or unix socket), each used by one call at a time.

    `execute` shares one connection among every call in flight (see there). `execute_many` takes
    an idle connection (the most recently used), or opens one while fewer than `max_connections`
    are open (the shared one counts), or waits (up to `timeout`) for one to come back; it has that
    connection to itself until its replies are in.
    """

    def __init__(
        self,
        address: Address,
        *,
        timeout: float = 2.0,
        connect_timeout: float | None = None,
        max_connections: int = 256,
    ) -> None:
        self.address = address
        self.host, self.port, self.path = address.host, address.port, address.path
        self.username, self.password, self.db = address.username, address.password, address.db
        self.timeout = timeout
        self.connect_timeout = timeout if connect_timeout is None else connect_timeout
        self.max_connections = max_connections
        self._idle: list[_Protocol] = []
        self._all: set[_Protocol] = set()
        self._opening = 0
        self._waiters: collections.deque[asyncio.Future[_Protocol | None]] = collections.deque()
        self._closed = False
        self._shared: _Protocol | None = None  # the connection every `execute` shares
        self._sharing: asyncio.Future[_Protocol] | None = None  # its connect, while it runs

    @classmethod
    def from_url(
        cls, url: str, *, timeout: float, max_connections: int = 256, options: dict[str, Any] | None = None
    ) -> RespPool | None:
        """A pool for a `redis://` or `unix://` URL (and `options`, as `redis.asyncio.Redis.from_url` takes
        them), or None when it needs more than we support. redis-py parses both (see `_url`)."""
        from redis.asyncio.connection import ConnectionPool

        if urlparse(url).scheme not in ("redis", "unix"):
            return None
        return cls._serving(ConnectionPool.from_url(url, **(options or {})), timeout, max_connections)

    @classmethod
    def from_client(cls, client: Any, *, timeout: float, max_connections: int = 256) -> RespPool | None:
        """A pool with the address and credentials of a user's `redis.asyncio.Redis`, or None when
        its connections need more than we support (TLS, RESP3, a credential provider, a client
        name, a custom connection class or pool such as Sentinel's: see `_url.lean_settings`).

        The pool opens its own connections (at most `max_connections`, or the client pool's own
        limit if lower); the client itself is left untouched. Calls are bounded by the client's
        `socket_timeout` (connects by its `socket_connect_timeout`), or by `timeout` when it has none.
        """
        import redis.asyncio as aioredis
        from redis.asyncio.connection import BlockingConnectionPool, ConnectionPool

        pool = getattr(client, "connection_pool", None)
        if type(client) is not aioredis.Redis or type(pool) not in (ConnectionPool, BlockingConnectionPool):
            return None
        return cls._serving(pool, timeout, max_connections)

    @classmethod
    def _serving(cls, pool: Any, timeout: float, max_connections: int) -> RespPool | None:
        settings = lean_settings(pool)
        if settings is None:
            return None
        kwargs = pool.connection_kwargs
        call = kwargs.get("socket_timeout") or timeout
        return cls(
            Address(**settings),
            timeout=call,
            connect_timeout=kwargs.get("socket_connect_timeout") or call,
            max_connections=min(max_connections, pool.max_connections),
        )

    @property
    def connections(self) -> int:
        """Connections open or being opened."""
        return len(self._all) + self._opening

    def script(self, source: str) -> Script:
        return Script(self, source)

    async def execute(self, *args: Any) -> Any:
        """Send one command on the shared connection and await its reply, within `timeout`.

        Every call in flight shares one connection: what the event loop's turn queued goes out in
        one write and the replies come back in order in one read (ioredis' auto-pipelining,
        redis-rs' multiplexed connection), so a busy worker pays one syscall per turn, not two
        per call. A stalled reply fails every call behind it (they wait on the same server); a
        cancelled caller's reply is read and dropped, the connection kept."""
        packed = _pack(args)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout
        proto = self._shared
        if proto is None or proto.closed:
            proto = await self._share(deadline)
        return await proto.queue(packed, deadline)

    async def _share(self, deadline: float) -> _Protocol:
        """The shared connection, (re)opened once for every caller waiting on it."""
        if self._closed:
            raise redis_errors.ConnectionError("connection pool closed by aclose()")
        if self._shared is not None and self._shared.closed:
            self._all.discard(self._shared)
            self._shared = None
        if self._sharing is None:
            self._sharing = asyncio.ensure_future(self._open_shared(deadline))
        sharing = self._sharing
        try:
            return await asyncio.shield(sharing)
        finally:
            if sharing.done() and self._sharing is sharing:
                self._sharing = None
                if not sharing.cancelled():
                    sharing.exception()  # retrieved, also when no caller is left to see it

    async def _open_shared(self, deadline: float) -> _Protocol:
        loop = asyncio.get_running_loop()
        proto = await self._connect(min(self.connect_timeout, max(0.0, deadline - loop.time())))
        self._all.add(proto)
        self._shared = proto
        return proto

    async def execute_many(self, *commands: tuple[Any, ...]) -> list[Any]:
        """Send `commands` pipelined on one connection (so a `WAIT` among them covers the writes
        before it); each reply, or the `RedisError` it was, in order. A lost connection raises."""
        packed = b"".join(_pack(c) for c in commands)
        deadline = asyncio.get_running_loop().time() + self.timeout
        proto = await self._acquire_idle(deadline)
        try:
            replies = await asyncio.gather(*proto.send_many(packed, len(commands), deadline), return_exceptions=True)
        except BaseException:  # cancelled: the replies would still come
            proto.abort(redis_errors.ConnectionError("call cancelled"))
            self._release(proto)
            raise
        self._release(proto)
        for reply in replies:
            if isinstance(reply, BaseException) and not isinstance(reply, redis_errors.ResponseError):
                raise reply  # the connection failed (or timed out): nothing is known
        return replies

    async def execute_alone(self, *args: Any) -> Any:
        """Send one command on a connection of its own (for a reply that may be large: it then holds
        up nobody else's); its reply, or its error raised."""
        (reply,) = await self.execute_many(args)
        if isinstance(reply, BaseException):
            raise reply
        return reply

    async def _acquire_idle(self, deadline: float) -> _Protocol:
        idle = self._idle
        while idle:
            proto = idle.pop()
            if not proto.closed:
                return proto
            self._all.discard(proto)
        return await self._acquire(deadline)

    def _release(self, proto: _Protocol | None) -> None:
        """Hand `proto` to the first waiter, or back to the idle list; None (or closed): a free slot."""
        if proto is not None and (proto.closed or self._closed):
            self._all.discard(proto)
            proto = None
        waiters = self._waiters
        while waiters:
            waiter = waiters.popleft()
            if not waiter.done():
                waiter.set_result(proto)  # None: a slot is free, open a connection
                return
        if proto is not None:
            self._idle.append(proto)

    async def _acquire(self, deadline: float) -> _Protocol:
        """A connection by `deadline`: a pooled one handed back, or a new one while there is room."""
        if self._closed:
            raise redis_errors.ConnectionError("connection pool closed by aclose()")
        loop = asyncio.get_running_loop()
        if self.connections >= self.max_connections:
            waiter: asyncio.Future[_Protocol | None] = loop.create_future()
            self._waiters.append(waiter)
            try:
                proto = await asyncio.wait_for(waiter, max(0.0, deadline - loop.time()))
            except BaseException as exc:
                if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                    self._release(waiter.result())  # handed over as we gave up: pass it on
                else:
                    waiter.cancel()
                if isinstance(exc, (TimeoutError, asyncio.TimeoutError)):
                    raise redis_errors.TimeoutError(f"no free redis connection within {self.timeout}s") from None
                raise  # our caller was cancelled (as redis-py's pool lets it be), or the pool closed
            if proto is not None:
                return proto
        self._opening += 1
        try:
            proto = await self._connect(min(self.connect_timeout, max(0.0, deadline - loop.time())))
        except BaseException:
            self._opening -= 1
            self._release(None)
            raise
        self._opening -= 1
        self._all.add(proto)
        return proto

    async def _connect(self, connect_timeout: float) -> _Protocol:
        loop = asyncio.get_running_loop()
        timeout = self.timeout
        made: list[_Protocol] = []

        def factory() -> _Protocol:
            made.append(_Protocol(timeout))
            return made[-1]

        async def handshake() -> _Protocol:
            if self.path is not None:
                transport, proto = await loop.create_unix_connection(factory, self.path)
            else:
                transport, proto = await loop.create_connection(factory, self.host, self.port)
            proto.transport = transport  # uvloop calls connection_made only later
            if self.password is not None:
                auth = (self.username, self.password) if self.username else (self.password,)
                await proto.send(_pack(("AUTH", *auth)))
            if self.db:
                await proto.send(_pack(("SELECT", self.db)))
            return proto

        try:
            proto = await asyncio.wait_for(handshake(), connect_timeout)
        except BaseException as exc:
            for made_proto in made:
                made_proto.abort(redis_errors.ConnectionError("connect failed"))
            if isinstance(exc, (TimeoutError, asyncio.TimeoutError)):
                raise redis_errors.TimeoutError(f"connect to redis timed out after {connect_timeout}s") from None
            if isinstance(exc, OSError):
                raise redis_errors.ConnectionError(f"cannot connect to redis: {exc}") from exc
            raise
        if self._closed:
            proto.abort(redis_errors.ConnectionError("connection pool closed by aclose()"))
            raise redis_errors.ConnectionError("connection pool closed by aclose()")
        return proto

    async def aclose(self) -> None:
        """Close every connection; calls still pending fail with `ConnectionError`."""
        self._closed = True
        waiters, self._waiters = self._waiters, collections.deque()
        for waiter in waiters:  # an exception, not cancel(): a cancelled wait is the caller's own cancellation
            if not waiter.done():
                waiter.set_exception(redis_errors.ConnectionError("connection pool closed by aclose()"))
        protos = list(self._all)
        self._all.clear()
        self._idle.clear()
        for proto in protos:
            proto.abort(redis_errors.ConnectionError("connection pool closed by aclose()"))
        for proto in protos:
            with contextlib.suppress(asyncio.TimeoutError, TimeoutError):
                await asyncio.wait_for(asyncio.shield(proto.lost), 1.0)
