"""How `PostgresBackend` runs a statement: bounded by one deadline, fair at the pool, errors wrapped.

`Runner.run` takes a first-come-first-served turn (`Turns`), a pooled connection and runs one
statement, all within the backend's `timeout`; a statement that times out hands its connection
back in the background. `wrapped` turns every asyncpg (or socket) error into the library's tree.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
from time import monotonic
from typing import Any, Final

from ...errors import BackendError, BackendMisconfigured, BackendUnavailable

try:
    import asyncpg
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    from ...errors import missing_extra

    raise missing_extra("PostgresBackend needs asyncpg", "postgres") from exc

# after the check above: these need asyncpg
from ._lean import LeanPool, broken_by
from ._pooler import pooler_refusal

# asyncpg raises asyncio.TimeoutError, which is the builtin TimeoutError only from Python 3.11.
_TIMEOUT: Final = (TimeoutError, asyncio.TimeoutError)
_UNAVAILABLE: Final = (
    OSError,
    *_TIMEOUT,
    asyncpg.InterfaceError,
    # a connection killed while a statement ran may surface as asyncpg's own state error
    # ("cannot switch to state 11; another operation is in progress"): lost, as a broken socket
    asyncpg.exceptions.InternalClientError,
    asyncpg.PostgresConnectionError,
    asyncpg.exceptions.OperatorInterventionError,  # admin/crash shutdown, cannot connect now, query canceled
    asyncpg.exceptions.InsufficientResourcesError,  # too many connections, disk full
    # target_session_attrs=read-write and no host is a primary yet (a failover in progress)
    asyncpg.exceptions.TargetServerAttributeNotMatched,
)


# The server answers, but refuses us for good: retrying cannot help (500, and a failed start-up).
_MISCONFIGURED: Final = (
    asyncpg.InvalidAuthorizationSpecificationError,  # no such role, wrong password (28000, 28P01)
    asyncpg.InvalidCatalogNameError,  # no such database (3D000)
    asyncpg.InvalidSchemaNameError,  # no such schema (3F000)
    asyncpg.InsufficientPrivilegeError,  # the role may not create or use the table (42501)
    asyncpg.UndefinedTableError,  # the table is gone and the role may not create it (42P01)
    asyncpg.UndefinedColumnError,  # a table of an older schema the role may not migrate (42703)
)


def wrapped(exc: BaseException, table: str = "idem_records") -> BackendError:
    """The library error for an asyncpg (or socket) error: misconfigured, unavailable, or another store error."""
    what = f"{type(exc).__name__}: {exc}"
    refusal = pooler_refusal(exc)
    if refusal is not None:
        return refusal
    if isinstance(exc, asyncpg.ClientConfigurationError):
        return BackendMisconfigured(f"postgres: invalid DSN or connection option ({what})")
    if isinstance(exc, asyncpg.InsufficientPrivilegeError | asyncpg.UndefinedTableError | asyncpg.UndefinedColumnError):
        return BackendMisconfigured(
            f"postgres refuses the table ({what}); fix: run `idem-asgi --backend <owner DSN> migrate` as the "
            f"table's owner, then GRANT SELECT, INSERT, UPDATE, DELETE ON {table} TO <the app's role>"
        )
    if isinstance(exc, _MISCONFIGURED):
        return BackendMisconfigured(
            f"postgres refuses the connection ({what}); fix: check the role, password, database and schema in the DSN"
        )
    if isinstance(exc, asyncpg.ReadOnlySQLTransactionError):
        return BackendUnavailable(f"postgres is read-only (a standby, or a failover in progress): {what}")
    if isinstance(exc, _UNAVAILABLE):
        return BackendUnavailable(f"postgres unavailable: {exc!r}")
    return BackendError(f"postgres error: {exc!r}")


class Runner:
    """Runs statements on a pool for one backend; `drain()` waits for connections still being handed back."""

    def __init__(self, timeout: float, table: str) -> None:
        self.timeout = timeout
        self.table = table
        self.isolate = False
        """Run each statement in a READ COMMITTED transaction: the sessions default to another level."""
        self._turns: Turns | None = None
        self._releasing: set[asyncio.Task[Any]] = set()

    async def run(self, pool: Any, method: str, sql: str, *args: Any, deadline: float | None = None) -> Any:
        """`conn.<method>(sql, *args)` on a pooled connection, within `timeout` (waiting for it included)."""
        # One deadline for the whole call: waiting for a pooled connection, then the statement.
        # When the statement times out, asyncpg sends the server a cancel request; the connection
        # goes back to the pool in the background (bounded by `timeout`, else it is terminated),
        # so a hung server costs the caller `timeout`, not two or three times it.
        if deadline is None:
            deadline = monotonic() + self.timeout
        if type(pool) is LeanPool:
            return await self._run_lean(pool, method, sql, args, deadline)
        try:
            remaining = deadline - monotonic()
            if remaining <= 0:
                raise TimeoutError
            if self._turns is None:
                self._turns = Turns(pool.get_max_size())
            turns = self._turns
            await turns.take(remaining)  # first come, first served (see _Turns)
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
            except _TIMEOUT:
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
        except (*_UNAVAILABLE, asyncpg.PostgresError) as exc:
            raise wrapped(exc, self.table) from exc

    async def _run_lean(self, pool: LeanPool, method: str, sql: str, args: tuple[Any, ...], deadline: float) -> Any:
        """`run` on the lean pool: no turns (its waiters are served in order), no timer unless it must wait."""
        try:
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
        except (*_UNAVAILABLE, asyncpg.PostgresError) as exc:
            raise wrapped(exc, self.table) from exc

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
            if isinstance(exc.__cause__, _TIMEOUT):
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
