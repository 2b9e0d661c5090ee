"""A lean pool of raw asyncpg connections for the `PostgresBackend` that `from_dsn` builds.

asyncpg's `Pool` wraps every connection it hands out in a proxy, arms a timer for the acquire and
another for the release, and queues waiters in a way that lets newcomers barge past them (hence
the backend's `Turns`). Per statement that costs about as much client CPU as the statement itself
(measured: 75 us through `pool.fetchval` against 37 us on the bare connection). Here a statement
takes the most recently used idle connection with no await and no timer; only a caller that
finds none waits, first come first served, on one timer. A connection with a broken socket is
terminated rather than handed back (see `broken_by`), and a waiter gets a fresh one.

It offers the part of asyncpg's `Pool` API the backend, its `transaction()` and the ops tools use
(`acquire`, `release`, `expire_connections`, `close`, `terminate`, the size getters).
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Generator
from typing import Any, Final

import asyncpg

POOL_ONLY: Final = frozenset({"max_queries", "max_inactive_connection_lifetime", "setup", "init", "connect", "loop"})
"""`asyncpg.create_pool` options this pool does not implement: given any of them, asyncpg's pool is used."""


class _Acquire:
    """`await pool.acquire()` or `async with pool.acquire() as conn`, as asyncpg's pool allows."""

    __slots__ = ("_conn", "_pool", "_timeout")

    def __init__(self, pool: LeanPool, timeout: float | None) -> None:
        self._pool = pool
        self._timeout = timeout
        self._conn: Any = None

    def __await__(self) -> Generator[Any, None, Any]:
        return self._pool.take(self._timeout).__await__()

    async def __aenter__(self) -> Any:
        self._conn = await self._pool.take(self._timeout)
        return self._conn

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        conn, self._conn = self._conn, None
        self._pool.put(conn, broken=broken_by(exc))


def broken_by(exc: BaseException | None) -> bool:
    """Whether a connection that raised `exc` must not be reused.

    A statement that timed out or whose caller was cancelled leaves the connection usable: asyncpg
    sent the server a cancel request, and the next statement on it waits for that to finish first
    (so the server never keeps running what the caller gave up on). A broken socket or an
    interface error leaves it unusable.
    """
    if exc is None or isinstance(exc, _REUSABLE):
        return False
    return isinstance(exc, OSError | asyncpg.InterfaceError | asyncpg.exceptions.InternalClientError)


_REUSABLE: Final = (asyncpg.PostgresError, TimeoutError, asyncio.TimeoutError, asyncio.CancelledError)


class LeanPool:
    """Up to `max_size` asyncpg connections to `dsn`, `min_size` of them opened by `start()`."""

    def __init__(self, dsn: str, *, min_size: int = 2, max_size: int = 20, **connect: Any) -> None:
        if max_size < 1 or not 0 <= min_size <= max_size:
            raise ValueError(f"need 0 <= min_size <= max_size and max_size >= 1, got {min_size}, {max_size}")
        self._dsn = dsn
        self._min = min_size
        self._max = max_size
        self._connect = connect
        self._idle: list[Any] = []
        self._busy: set[Any] = set()
        self._opening = 0
        self._waiters: collections.deque[asyncio.Future[Any]] = collections.deque()
        self._old: set[Any] = set()  # handed out before expire_connections(): not reused
        self._closing = False
        self._tasks: set[asyncio.Task[Any]] = set()

    async def start(self) -> LeanPool:
        """Open `min_size` connections; raise (leaving nothing open) when the server cannot be reached."""
        try:
            conns = await asyncio.gather(*(self._open() for _ in range(self._min)))
        except BaseException:
            self.terminate()
            raise
        self._idle.extend(conns)
        return self

    # -- sizes, as asyncpg's Pool reports them --------------------------------------------------

    def get_max_size(self) -> int:
        return self._max

    def get_size(self) -> int:
        """Connections open, in use or idle."""
        return len(self._idle) + len(self._busy)

    def is_closing(self) -> bool:
        return self._closing

    # -- taking and giving back ------------------------------------------------------------------

    def acquire(self, *, timeout: float | None = None) -> _Acquire:
        return _Acquire(self, timeout)

    def take_now(self) -> Any:
        """An idle connection at once, or None (none idle, or callers already waiting for one)."""
        idle = self._idle
        while idle and not self._waiters:
            conn = idle.pop()
            if not conn.is_closed():
                self._busy.add(conn)
                return conn
        return None

    async def take(self, timeout: float | None) -> Any:
        """A connection within `timeout` seconds: idle, newly opened, or the next one given back."""
        conn = self.take_now()
        if conn is not None:
            return conn
        if self._closing:
            raise asyncpg.InterfaceError("pool is closed")
        if self.get_size() + self._opening < self._max:
            conn = await self._open_shielded(timeout)
            self._busy.add(conn)
            return conn
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[Any] = loop.create_future()
        self._waiters.append(waiter)
        timer = None if timeout is None else loop.call_later(timeout, _expire, waiter)
        try:
            conn = await waiter
        except BaseException:
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                self.put(waiter.result())  # handed one just as we gave up: pass it on
            raise
        finally:
            if timer is not None:
                timer.cancel()
        return conn

    async def release(self, conn: Any) -> None:
        """Give `conn` back (asyncpg's `Pool.release`); one still in a transaction is terminated."""
        self.put(conn)

    def put(self, conn: Any, *, broken: bool = False) -> None:
        """Give `conn` back: to the longest waiter, else to the idle list; a broken one is terminated."""
        self._busy.discard(conn)
        if broken or self._closing or conn in self._old or conn.is_closed() or conn.is_in_transaction():
            self._old.discard(conn)
            if not conn.is_closed():
                conn.terminate()
            self._refill()
            return
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                self._busy.add(conn)
                waiter.set_result(conn)
                return
        self._idle.append(conn)

    # -- opening, expiring, closing ----------------------------------------------------------------

    async def _open_shielded(self, timeout: float | None) -> Any:
        """Open a connection in a task of its own: a caller cancelled meanwhile leaves it to finish and
        join the pool (asyncpg's connect, cancelled midway, leaves futures whose errors nobody reads)."""
        self._opening += 1  # counted before the task runs, so concurrent takers respect max_size
        task = asyncio.get_running_loop().create_task(self._open(timeout, counted=True))
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            task.add_done_callback(self._adopt)
            raise

    def _adopt(self, task: asyncio.Task[Any]) -> None:
        """The connection its caller gave up on: into the pool (or to a waiter); its error, read."""
        if task.cancelled() or task.exception() is not None:
            self._refill()
            return
        conn = task.result()
        self._busy.add(conn)
        self.put(conn)

    async def _open(self, timeout: float | None = None, *, counted: bool = False) -> Any:
        if not counted:
            self._opening += 1
        try:
            options = dict(self._connect)
            if timeout is not None:
                options["timeout"] = max(timeout, 0.001)
            return await asyncpg.connect(self._dsn, **options)
        finally:
            self._opening -= 1

    def _refill(self) -> None:
        """A connection went away: open one for the longest waiter, if anyone waits."""
        if self._closing or not any(not w.done() for w in self._waiters):
            return
        if self.get_size() + self._opening >= self._max:
            return
        task = asyncio.get_running_loop().create_task(self._open_for_waiter())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _open_for_waiter(self) -> None:
        try:
            conn = await self._open(self._connect.get("timeout", 60.0))
        except Exception as exc:
            while self._waiters:  # the oldest waiter learns why (a down server), the others keep waiting
                waiter = self._waiters.popleft()
                if not waiter.done():
                    waiter.set_exception(exc)
                    return
            return
        self._busy.add(conn)
        self.put(conn)

    async def expire_connections(self) -> None:
        """Replace every connection: idle ones are closed now, busy ones when given back."""
        idle, self._idle = self._idle, []
        self._old |= self._busy
        for conn in idle:
            conn.terminate()

    async def close(self) -> None:
        """Close idle connections gracefully and refuse new takers; busy ones close when given back."""
        self._closing = True
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_exception(asyncpg.InterfaceError("pool is closed"))
        self._waiters.clear()
        idle, self._idle = self._idle, []
        await asyncio.gather(*(conn.close(timeout=5) for conn in idle), return_exceptions=True)
        for task in list(self._tasks):
            task.cancel()

    def terminate(self) -> None:
        """Close every connection at once, in use or not."""
        self._closing = True
        for conn in [*self._idle, *self._busy]:
            if not conn.is_closed():
                conn.terminate()
        self._idle.clear()
        self._busy.clear()


def _expire(waiter: asyncio.Future[Any]) -> None:
    if not waiter.done():
        waiter.set_exception(TimeoutError())
