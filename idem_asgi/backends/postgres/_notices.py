"""One `LISTEN` connection per `PostgresBackend`, for repeats held in this process on a claim held
in another: the statements that end a watched claim `NOTIFY` its digest on the table's channel.

Opened on the first `watch` (a connection of its own, outside the pool: a pooled one would go
back with the subscription on it). A notice sent while it is down is never seen, so each drop
tells every listener `None` ("anything may have changed"): held repeats read their records
again, and poll until it is back. A connection that dies silently is found by a ping every
`PING_EVERY` seconds. Behind a transaction-mode pooler (PgBouncer) `LISTEN` does not work, and
the backend never opens one (repeats poll, as before).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import asyncpg

from ...records import RecordKey
from .._listeners import Listeners
from ._setup import Setup
from ._sql import Statements

logger = logging.getLogger("idem_asgi")

PING_EVERY = 5.0
WATCHED_MAX = 10_000  # keys remembered as watched; past it all are forgotten (repeats ask again)


def channel_of(table: str) -> str:
    """The table's channel: a short identifier (channels are names of at most 63 bytes)."""
    return "idem_" + hashlib.sha256(table.encode()).hexdigest()[:24]


class Notices(Listeners):
    def __init__(self, dsn: str, channel: str, timeout: float) -> None:
        super().__init__()
        self._dsn = dsn
        self._channel = channel
        self._timeout = timeout
        self.connection: Any = None  # the listening connection, while it is up (tests cut it)
        # Claims (digest, token) this process has marked watched and not yet heard end: the next
        # repeat held on one needs no row update (many repeats held on one key make one).
        self._watched: dict[str, set[int]] = {}

        self._marking: dict[tuple[str, int], asyncio.Future[Any]] = {}

    async def mark(self, digest: str, token: int, update: Callable[[], Awaitable[Any]]) -> Any:
        """Mark the claim watched by `update()` (its row update: True, False or None), once: a
        repeat held on a claim marked already gets True; concurrent ones share the one update
        (which would otherwise find the row locked by it, and poll)."""
        if token in self._watched.get(digest, ()):
            return True
        pending = self._marking.get((digest, token))
        if pending is not None:
            try:
                return await asyncio.shield(pending)
            except asyncio.CancelledError:
                if pending.cancelled():
                    return None  # its caller was cancelled mid-update: poll this time
                raise
        pending = self._marking[(digest, token)] = asyncio.get_running_loop().create_future()
        try:
            result = await update()
        except Exception as exc:
            pending.set_exception(exc)
            pending.exception()  # retrieved: a caller may not be waiting
            raise
        except BaseException:
            pending.cancel()
            raise
        else:
            pending.set_result(result)
            if result:
                if len(self._watched) >= WATCHED_MAX:
                    self._watched.clear()  # holders that died tell nobody: never grow without bound
                self._watched.setdefault(digest, set()).add(token)
            return result
        finally:
            del self._marking[(digest, token)]

    async def _run(self, ready: asyncio.Event) -> None:
        delay = 0.1
        while True:
            lost = asyncio.Event()
            conn: Any = None
            try:
                conn = await asyncpg.connect(self._dsn, timeout=self._timeout, statement_cache_size=0)
                conn.add_termination_listener(lambda _conn, lost=lost: lost.set())
                await conn.add_listener(self._channel, self._notified)
                self.connection = conn
                ready.set()
                delay = 0.1
                while not lost.is_set():
                    with contextlib.suppress(asyncio.TimeoutError):  # (not the builtin on 3.10)
                        await asyncio.wait_for(lost.wait(), PING_EVERY)
                        break
                    await conn.fetchval("SELECT 1", timeout=self._timeout)
            except (TimeoutError, OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
                logger.info("idem_asgi: postgres notices interrupted (%r); listening again", exc)
            finally:
                self.connection = None
                if conn is not None:
                    conn.terminate()
            ready.clear()
            self._tell_all(None)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 5.0)

    def _notified(self, _conn: Any, _pid: int, _channel: str, payload: str) -> None:
        self._tell_all(payload)

    def _tell_all(self, digest: str | None) -> None:
        if digest is None:
            self._watched.clear()
        else:
            self._watched.pop(digest, None)
        super()._tell_all(digest)


class Watching(Setup):
    """`PostgresBackend.watch`: held repeats told by LISTEN/NOTIFY (set up by the backend)."""

    _notices: Notices | None
    _channel: str
    sql: Statements
    _id: Callable[[RecordKey], tuple[str, str, str]]

    async def watch(self, key: RecordKey, token: int, on_change: Callable[[str | None], None]) -> bool | None:
        """Have `on_change(digest)` called when the claim `token` of `key` ends (a NOTIFY on the
        table's channel, heard by one LISTEN connection per backend); `on_change(None)`: notices
        were interrupted, any claim may have ended unseen.

        True: it will be told. False: it ended already (read it again). None: no notices now (a
        pool of the app's own or a transaction-mode pooler, where LISTEN cannot work; the row
        locked by the holder; the listening connection not up within `timeout`): poll instead.
        """
        pool = await self._get_pool()  # (probes for a pooler)
        if self._dsn is None or self._pooled:
            return None
        if self._notices is None:
            self._notices = Notices(self._dsn, self._channel, self.timeout)
        if not await self._notices.listen(on_change, self.timeout):
            return None
        # One row update per claim and process, however many repeats are held on it here.
        watching = await self._notices.mark(
            key.digest, token, lambda: self._runner.run(pool, "fetchval", self.sql.watch, *self._id(key), token)
        )
        return None if watching is None else bool(watching)
