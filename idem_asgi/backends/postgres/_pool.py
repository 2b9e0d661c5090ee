"""How `PostgresBackend` runs a statement: bounded by one deadline, fair at the pool, errors wrapped.

`Runner.run` takes a first-come-first-served turn (`Turns`), a pooled connection and runs one
statement, all within the backend's `timeout`; a statement that times out hands its connection
back in the background. Every asyncpg (or socket) error becomes the library's (`_errors`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from time import monotonic
from typing import Any

from ...errors import BackendUnavailable

try:
    import asyncpg  # noqa: F401  # the check that the extra is installed
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    from ...errors import missing_extra

    raise missing_extra("PostgresBackend needs asyncpg", "postgres") from exc

# after the check above: these need asyncpg
from ._errors import CAUGHT, TIMEOUT, DriverErrors, wrapped
from ._lean import LeanPool, broken_by


class Runner:
    """Runs statements on a pool for one backend; `drain()` waits for connections still being handed back."""

    def __init__(self, timeout: float, table: str) -> None:
        self.timeout = timeout
        self.errors = DriverErrors(table)
        """The store's one mapping of driver errors, also used by the backend's own asyncpg calls."""
        self.isolate = False
        """Run each statement in a READ COMMITTED transaction: the sessions default to another level."""
        self._turns: Turns | None = None
        self._releasing: set[asyncio.Task[Any]] = set()

    async def run(self, pool: Any, method: str, sql: str, *args: Any, deadline: float | None = None) -> Any:
        """`conn.<method>(sql, *args)` on a pooled connection, within `timeout` (waiting for it included)."""
        # One deadline for the whole call: waiting for a pooled connection, then the statement.
        if deadline is None:
            deadline = monotonic() + self.timeout
        try:
            if type(pool) is LeanPool:
                return await self._run_lean(pool, method, sql, args, deadline)
            return await self._run_pooled(pool, method, sql, args, deadline)
        except CAUGHT as exc:  # `self.errors` inline: a `with` costs 0.3 us on every statement
            raise wrapped(exc, self.errors.table) from exc

    async def _run_pooled(self, pool: Any, method: str, sql: str, args: tuple[Any, ...], deadline: float) -> Any:
        """`run` on asyncpg's pool, behind a first-come-first-served turn (see `Turns`).

        When the statement times out, asyncpg sends the server a cancel request; the connection
        goes back to the pool in the background (bounded by `timeout`, else it is terminated),
        so a hung server costs the caller `timeout`, not two or three times it.
        """
        remaining = deadline - monotonic()
        if remaining <= 0:
            raise TimeoutError
        if self._turns is None:
            self._turns = Turns(pool.get_max_size())
        turns = self._turns
        await turns.take(remaining)
        try:
            conn = await pool.acquire(timeout=max(deadline - monotonic(), 0.001))
        except BaseException:
            turns.give_back()
            raise
        release = True
        try:
            remaining = deadline - monotonic()
            if remaining <= 0:
                raise TimeoutError
            return await self._statement(conn, method, sql, args, remaining)
        except TIMEOUT:
            release = False
            task = asyncio.get_running_loop().create_task(release_quietly(pool, conn, turns))
            self._releasing.add(task)
            task.add_done_callback(self._releasing.discard)
            raise
        finally:
            if release:
                try:
                    await pool.release(conn)
                finally:
                    turns.give_back()

    async def _run_lean(self, pool: LeanPool, method: str, sql: str, args: tuple[Any, ...], deadline: float) -> Any:
        """`run` on the lean pool: no turns (its waiters are served in order), no timer unless it must wait."""
        conn = pool.take_now()
        if conn is None:
            remaining = deadline - monotonic()
            if remaining <= 0:
                raise TimeoutError
            conn = await pool.take(remaining)
        try:
            result = await self._statement(conn, method, sql, args, max(deadline - monotonic(), 0.001))
        except BaseException as exc:
            pool.put(conn, broken=broken_by(exc))
            raise
        pool.put(conn)
        return result

    def _statement(self, conn: Any, method: str, sql: str, args: tuple[Any, ...], timeout: float) -> Any:
        """`conn.<method>(sql, *args)`, in a READ COMMITTED transaction when `isolate` says so."""
        if not self.isolate:
            return getattr(conn, method)(sql, *args, timeout=timeout)
        return _read_committed(conn, method, sql, args, timeout)

    async def run_again(self, pool: Any, method: str, sql: str, *args: Any) -> tuple[Any, bool]:
        """Run a statement; after a broken connection, once more on a fresh one, within one deadline.

        Returns (result, retried). A broken connection (terminated backend, server restart, reset)
        leaves it unknown whether the statement committed, so only statements that can tell their
        own earlier effect apart are run this way. Timeouts are not retried: the server may be hung.
        """
        deadline = monotonic() + self.timeout
        try:
            return await self.run(pool, method, sql, *args, deadline=deadline), False
        except BackendUnavailable as exc:
            if isinstance(exc.__cause__, TIMEOUT):
                raise
            # What broke one connection (a restart, a mass pg_terminate_backend) usually broke the
            # idle ones too: have the pool replace them all instead of handing us the next corpse.
            await pool.expire_connections()
        return await self.run(pool, method, sql, *args, deadline=deadline), True

    async def drain(self) -> None:
        """Wait for connections still being handed back after a timeout."""
        if self._releasing:
            await asyncio.gather(*self._releasing, return_exceptions=True)


async def _read_committed(conn: Any, method: str, sql: str, args: tuple[Any, ...], timeout: float) -> Any:
    async with conn.transaction(isolation="read_committed"):
        return await getattr(conn, method)(sql, *args, timeout=timeout)


async def release_quietly(pool: Any, conn: Any, turns: Turns) -> None:
    # The pool terminates a connection it could not reset in time and re-raises; nobody waits
    # for this task, so there is nobody to tell.
    try:
        with contextlib.suppress(Exception):
            await pool.release(conn)
    finally:
        turns.give_back()


class Turns:
    """First come, first served turns at the pool's connections, one per connection.

    asyncpg's pool hands a connection coming back to whichever coroutine asks next, not to the one
    waiting longest (its asyncio.Queue lets a newcomer take the item a woken waiter was promised;
    MagicStack/asyncpg#1247). With more requests in flight than connections, a few then starve
    until their timeout while the rest get through: a 503 for a claim, a lost completion
    (outcome-unknown) for a completion. Taking a turn before the connection makes the wait FIFO:
    a turn given back goes straight to the oldest waiter, and a newcomer queues behind them.
    """

    def __init__(self, size: int) -> None:
        self._free = size
        self._waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    async def take(self, within: float) -> None:
        """Wait for a turn; TimeoutError after `within` seconds."""
        if self._free > 0 and not self._waiters:
            self._free -= 1
            return
        loop = asyncio.get_running_loop()
        turn: asyncio.Future[None] = loop.create_future()
        self._waiters.append(turn)

        def expire() -> None:
            if not turn.done():
                turn.set_exception(TimeoutError())

        timer = loop.call_later(within, expire)
        try:
            await turn
        except BaseException:
            if turn.done() and not turn.cancelled() and turn.exception() is None:
                self.give_back()  # given a turn just as we were cancelled: pass it on
            raise
        finally:
            timer.cancel()

    def give_back(self) -> None:
        while self._waiters:
            turn = self._waiters.popleft()
            if not turn.done():  # (skips waiters that timed out or were cancelled)
                turn.set_result(None)
                return
        self._free += 1


async def keep_session(connection: Any) -> None:
    """Pool reset hook that sends nothing: our statements leave no session state to reset."""
