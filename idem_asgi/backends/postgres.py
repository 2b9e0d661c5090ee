"""PostgreSQL store on asyncpg: one statement to claim-or-read, fenced UPDATE/DELETE after it.

The claim is one statement: a snapshot read of the row, an `INSERT ... ON CONFLICT DO NOTHING`
when there is none, and a re-checked `UPDATE` when it is free (TTL over, or an expired lease
being taken over), so a new key and a replay each cost one round trip, a replay writes nothing,
and an expired row is taken over atomically, never by delete-then-insert. Times are the
server's `now()`. The body is kept verbatim as `bytea`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import logging
import re
from collections.abc import AsyncIterator
from contextvars import ContextVar
from time import monotonic
from typing import Any, ClassVar, Final, Literal

import anyio
import msgspec

from ..context import ClaimHandle, current_idempotency
from ..errors import (
    BackendError,
    BackendMisconfigured,
    BackendUnavailable,
    ClaimLost,
    ConfigurationError,
    MissingExtra,
)
from ..records import COMPLETED, IN_PROGRESS, Claimed, ClaimResult, Existing, Record, RecordKey, StoredResponse
from ..records import StaleRecord as StaleRecord  # re-exported: it was defined here before records.py
from ._base import ClosingMixin, new_token
from ._orphans import OrphanSweeper

try:
    import asyncpg
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise MissingExtra("PostgresBackend needs asyncpg: pip install 'idem-asgi[postgres]'") from exc

logger = logging.getLogger("idem_asgi")
_IDENT: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,62}")
_headers_encode = msgspec.msgpack.Encoder().encode
_headers_decode = msgspec.msgpack.Decoder(list[tuple[bytes, bytes]]).decode

DDL: Final = """\
CREATE TABLE IF NOT EXISTS {table} (
    namespace   text        NOT NULL,
    scope       text        NOT NULL,
    key         text        NOT NULL,
    state       "char"      NOT NULL,            -- 'p' in progress, 'e' in progress with its effect committed
                                                 -- (see PostgresBackend.transaction), 'u' in progress whose
                                                 -- holder failed mid-answer (mark_failed), 'c' completed
    fingerprint bytea       NOT NULL,
    token       bigint      NOT NULL,            -- fencing token of the current holder
    lease_until timestamptz NOT NULL,
    expires_at  timestamptz NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    status      integer,
    headers     bytea,                           -- msgpack list of [name, value] byte pairs, in order
    body        bytea,                           -- response body, verbatim
    replayable  boolean,
    checkpoint  text,                            -- the last step the handler recorded (checkpoint())
    trailers    bytea,                           -- msgpack list of HTTP trailer pairs, NULL when none
    ttl         float8,                          -- seconds the record was claimed for (reconcile keeps that)
    PRIMARY KEY (namespace, scope, key)
);
ALTER TABLE {table} ADD COLUMN IF NOT EXISTS checkpoint text;
ALTER TABLE {table} ADD COLUMN IF NOT EXISTS trailers bytea;
ALTER TABLE {table} ADD COLUMN IF NOT EXISTS ttl float8;
CREATE INDEX IF NOT EXISTS {expires_index} ON {table} (expires_at);
CREATE INDEX IF NOT EXISTS {inflight_index} ON {table} (lease_until) WHERE state <> 'c';
"""

_COLUMNS: Final = (
    "state, fingerprint, token, extract(epoch from lease_until)::float8 AS lease_until, "
    "extract(epoch from expires_at)::float8 AS expires_at, status, headers, body, replayable, "
    "extract(epoch from now())::float8 AS now, checkpoint, trailers, ttl"
)


# asyncpg raises asyncio.TimeoutError, which is the builtin TimeoutError only from Python 3.11.
_TIMEOUT: Final = (TimeoutError, asyncio.TimeoutError)
_UNAVAILABLE: Final = (
    OSError,
    *_TIMEOUT,
    asyncpg.InterfaceError,
    asyncpg.PostgresConnectionError,
    asyncpg.exceptions.OperatorInterventionError,  # admin/crash shutdown, cannot connect now, query canceled
    asyncpg.exceptions.InsufficientResourcesError,  # too many connections, disk full
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


def _wrapped(exc: BaseException, table: str = "idem_records") -> BackendError:
    """The library error for an asyncpg (or socket) error: misconfigured, unavailable, or another store error."""
    what = f"{type(exc).__name__}: {exc}"
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


def _index_name(table: str, suffix: str) -> str:
    """A quoted index name for `table` that stays distinct within Postgres's 63-byte limit."""
    name = f"{table}_{suffix}"
    if len(name) > 63:
        name = f"{table[:40]}_{hashlib.sha256(table.encode()).hexdigest()[:8]}_{suffix}"
    return f'"{name}"'


_open_connection: ContextVar[Any] = ContextVar("idem_asgi_postgres_transaction", default=None)
"""The connection of the `transaction()` block open in this task, for blocks nested in it."""


def _holds(backend: Any, target: PostgresBackend) -> bool:
    """Whether `backend` is `target`, or a wrapper around it (`.wrapped`, as the testing plugin makes)."""
    for _ in range(8):
        if backend is target:
            return True
        backend = getattr(backend, "wrapped", None)
        if backend is None:
            return False
    return False


class PostgresBackend(ClosingMixin):
    """Idempotency records in a PostgreSQL table through an asyncpg pool.

    Args:
        pool: An `asyncpg.Pool`; it stays yours (`aclose()` closes only a pool built by `from_dsn`).
        table: Table name, optionally `schema.table`.
        timeout: Bound in seconds on each store call, waiting for a pooled connection included;
            a call that runs out answers `BackendUnavailable` (the middleware's 503).
    """

    def __init__(self, pool: Any = None, *, table: str = "idem_records", timeout: float = 5.0) -> None:
        parts = table.split(".")
        if len(parts) > 2 or not all(_IDENT.fullmatch(p) for p in parts):
            raise ConfigurationError(f"invalid table name {table!r}")
        self.table = ".".join(f'"{p}"' for p in parts)
        self._indexes = {
            "expires_index": _index_name(parts[-1], "expires_idx"),
            "inflight_index": _index_name(parts[-1], "inflight_idx"),
        }
        schema = f'"{parts[0]}".' if len(parts) == 2 else ""
        self._relations = [self.table, *(schema + name for name in self._indexes.values())]
        self.timeout = timeout
        self._pool = pool
        self._dsn: str | None = None
        self._pool_options: dict[str, Any] = {}
        self._create_table = True
        self._owned = False
        self._lock = anyio.Lock()
        self._orphans = OrphanSweeper(self._abandon_claim)
        self._releasing: set[asyncio.Task[Any]] = set()
        self._turns: _Turns | None = None
        t = self.table
        # Claim-or-read in one statement that takes no lock and writes nothing unless it claims:
        # `cur` reads the row in the statement's snapshot; a live row is returned as is (a replay
        # or a 409 is a plain read: no row lock, no transaction id, no WAL flush at commit). With
        # no row, `ins` inserts; with a free row (TTL over, or the lease of `$8` ended), `upd`
        # takes it over, its WHERE re-checked on the newest row version. Both arms are exclusive.
        # The statement returns no row when it lost a race it cannot see: a concurrent insert
        # that committed after our snapshot (ON CONFLICT DO NOTHING waits for it, then does
        # nothing, and the row is invisible to `cur`), or a free row another claimer or purge
        # changed first. The caller then runs it again with a fresh snapshot.
        free = "(r.expires_at <= now())"  # a claim takes over only a row past its TTL
        reset = """
        state = 'p', fingerprint = $4, token = $5, created_at = now(), ttl = $7::float8,
        lease_until = now() + $6::float8 * interval '1 second', expires_at = now() + $7::float8 * interval '1 second',
        status = NULL, headers = NULL, body = NULL, replayable = NULL, checkpoint = NULL, trailers = NULL"""
        self._sql_claim = f"""
WITH cur AS (
    SELECT {_COLUMNS}, {free} AS free FROM {t} AS r WHERE namespace = $1 AND scope = $2 AND key = $3
), ins AS (
    INSERT INTO {t} (namespace, scope, key, state, fingerprint, token, lease_until, expires_at, ttl)
    SELECT $1, $2, $3, 'p', $4, $5, now() + $6::float8 * interval '1 second', now() + $7::float8 * interval '1 second',
           $7::float8
    WHERE NOT EXISTS (SELECT 1 FROM cur)
    ON CONFLICT (namespace, scope, key) DO NOTHING
    RETURNING true
), upd AS (
    UPDATE {t} AS r SET {reset}
    WHERE namespace = $1 AND scope = $2 AND key = $3 AND EXISTS (SELECT 1 FROM cur WHERE free) AND {free}
    RETURNING true
)
SELECT true, NULL::"char", NULL::bytea, NULL::bigint, NULL::float8, NULL::float8,
       NULL::integer, NULL::bytea, NULL::bytea, NULL::boolean, NULL::float8, NULL::text, NULL::bytea, NULL::float8
FROM ins
UNION ALL
SELECT true, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL FROM upd
UNION ALL
SELECT false, state, fingerprint, token, lease_until, expires_at, status, headers, body, replayable, now, checkpoint,
       trailers, ttl
FROM cur WHERE NOT free
"""
        # A takeover: the same update, of a held record whose lease of `$8` ended, never an insert. 'gone'
        # when no live record exists (released, or past its TTL): recovery must not resurrect it.
        held_free = "(r.state IN ('p', 'u') AND r.token = $8 AND r.lease_until <= now() AND r.expires_at > now())"
        self._sql_takeover = f"""
WITH cur AS (
    SELECT {_COLUMNS}, {held_free} AS free, r.expires_at > now() AS live
    FROM {t} AS r WHERE namespace = $1 AND scope = $2 AND key = $3
), upd AS (
    UPDATE {t} AS r SET {reset}
    WHERE namespace = $1 AND scope = $2 AND key = $3 AND EXISTS (SELECT 1 FROM cur WHERE free) AND {held_free}
    RETURNING true
)
SELECT 'taken'::text, NULL::"char", NULL::bytea, NULL::bigint, NULL::float8, NULL::float8,
       NULL::integer, NULL::bytea, NULL::bytea, NULL::boolean, NULL::float8, NULL::text, NULL::bytea, NULL::float8
FROM upd
UNION ALL
SELECT 'held', state, fingerprint, token, lease_until, expires_at, status, headers, body, replayable, now, checkpoint,
       trailers, ttl
FROM cur WHERE live AND NOT free
UNION ALL
SELECT 'gone', NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL, NULL
WHERE NOT EXISTS (SELECT 1 FROM cur WHERE live)
"""
        held = "namespace = $1 AND scope = $2 AND key = $3 AND token = $4"
        where = f"{held} AND state IN ('p', 'e')"
        self._sql_complete = f"""
UPDATE {t} SET state = 'c', status = $5, headers = $6, body = $7, replayable = $8, trailers = $10,
    lease_until = now(), expires_at = now() + $9::float8 * interval '1 second'
WHERE {where}"""
        # Never release a record whose effect committed ('e'): a retry must not run it again.
        self._sql_release = f"DELETE FROM {t} WHERE {held} AND state = 'p'"
        # Idempotent: a second transaction() block of the same request marks it again, harmlessly.
        self._sql_effect = f"UPDATE {t} SET state = 'e' WHERE {held} AND state IN ('p', 'e')"
        self._sql_holder = f"SELECT state FROM {t} WHERE {held}"
        self._sql_checkpoint = f"UPDATE {t} SET checkpoint = $5 WHERE {where}"
        self._sql_completed_by = f"""
SELECT true FROM {t} WHERE namespace = $1 AND scope = $2 AND key = $3 AND token = $4 AND state = 'c'"""
        # The record outlives its TTL while its holder still runs (renewal), so nobody claims a live key.
        self._sql_extend = f"""
UPDATE {t} SET lease_until = greatest(lease_until, now() + $5::float8 * interval '1 second'),
    expires_at = greatest(expires_at, now() + $5::float8 * interval '1 second') WHERE {where}"""
        # The holder failed mid-answer: lease over now; 'u' (never released), or 'e' kept as it is.
        self._sql_fail = f"""
UPDATE {t} SET lease_until = least(lease_until, now()), state = CASE WHEN state = 'e' THEN 'e' ELSE 'u' END
WHERE {where}"""
        self._sql_get = f"""
SELECT false, {_COLUMNS} FROM {t} WHERE namespace = $1 AND scope = $2 AND key = $3 AND expires_at > now()"""
        # Row locks are taken by the inner SELECT and skipped when held (a claim re-using an
        # expired row), so a purge never waits on, nor blocks, live traffic for long. TIDs in an
        # array make a TID scan, where `ctid IN (subquery)` would scan the whole table per batch.
        self._sql_purge = f"""
DELETE FROM {t} WHERE ctid = ANY(ARRAY(
    SELECT ctid FROM {t} WHERE expires_at <= now() LIMIT $1 FOR UPDATE SKIP LOCKED
)) AND expires_at <= now()"""
        self._sql_stale = f"""
SELECT false, {_COLUMNS}, namespace, scope, key FROM {t}
WHERE state <> 'c' AND lease_until <= now() - $1::float8 * interval '1 second' AND expires_at > now()
  AND ($3::text IS NULL OR namespace = $3)
ORDER BY lease_until LIMIT $2"""

    SCHEMES: ClassVar[tuple[str, ...]] = ("postgres", "postgresql")

    @classmethod
    def from_url(cls, url: str, **options: Any) -> PostgresBackend:
        """`postgresql://...`: the same as `from_dsn(url, **options)`."""
        return cls.from_dsn(url, **options)

    @classmethod
    def from_dsn(
        cls,
        dsn: str,
        *,
        table: str = "idem_records",
        timeout: float = 5.0,
        create_table: bool = True,
        **pool_options: Any,
    ) -> PostgresBackend:
        """A backend that creates (and owns) its pool on first use, and its table if missing.

        With `create_table=False` the table is never created as a side effect (only `setup()`
        creates it): a missing table is then a `BackendMisconfigured` naming `idem-asgi migrate`.

        `pool_options` go to `asyncpg.create_pool` (defaults: `min_size=2`, `max_size=20`). The
        pool's sessions are pinned to READ COMMITTED, which the claim statement relies on, unless
        `server_settings` says otherwise. Connections go back to the pool without asyncpg's reset
        query (`RESET ALL; UNLISTEN *; ...`): the backend leaves no session state behind, and the
        reset would double the round trips (asyncpg still rolls back an open transaction itself).
        """
        backend = cls(table=table, timeout=timeout)
        backend._dsn = dsn
        backend._create_table = create_table
        server_settings = {"default_transaction_isolation": "read committed", **pool_options.pop("server_settings", {})}
        backend._pool_options = {
            "min_size": 2,
            "max_size": 20,
            "server_settings": server_settings,
            "reset": _keep_session,
            **pool_options,
        }
        backend._owned = True
        return backend

    @property
    def ddl(self) -> str:
        """The schema as SQL text, for migration tools."""
        return DDL.format(table=self.table, **self._indexes)

    async def _get_pool(self) -> Any:
        if self._pool is not None:
            return self._pool
        if self._dsn is None:
            raise ConfigurationError("PostgresBackend needs a pool or PostgresBackend.from_dsn(dsn)")
        # The wait for another request's attempt counts against this request's timeout: with the
        # server hung, the tenth caller would otherwise wait ten timeouts.
        try:
            with anyio.fail_after(self.timeout):
                async with self._lock:
                    if self._pool is None:
                        pool = await asyncpg.create_pool(self._dsn, **self._pool_options)
                        try:
                            if self._create_table:
                                async with pool.acquire() as conn:
                                    await self._create(conn)
                        except BaseException:
                            pool.terminate()
                            raise
                        self._pool = pool
        except (*_UNAVAILABLE, asyncpg.PostgresError) as exc:
            raise _wrapped(exc, self.table) from exc
        except ValueError as exc:  # an unparseable DSN (asyncpg's ClientConfigurationError is one too)
            raise BackendMisconfigured(f"postgres: invalid DSN: {exc}") from exc
        return self._pool

    async def _create(self, conn: Any) -> None:
        exists = "SELECT " + " AND ".join(f"to_regclass(${i}) IS NOT NULL" for i in range(1, len(self._relations) + 1))
        # (and the newest column: tables made by earlier releases get it from the DDL's ALTER)
        exists += " AND EXISTS (SELECT 1 FROM pg_attribute WHERE attrelid = to_regclass($1) AND attname = 'ttl')"
        if await conn.fetchval(exists, *self._relations, timeout=self.timeout):
            return  # nothing to do, and no lock taken on a table that is serving
        # CREATE ... IF NOT EXISTS is not safe against itself: two workers starting together can
        # both pass the check and one fails on pg_type's unique index. A transaction-scoped
        # advisory lock on the table name serialises them.
        async with conn.transaction():
            await conn.execute(
                "SELECT pg_advisory_xact_lock(hashtextextended($1, 1953))", self.table, timeout=self.timeout
            )
            await conn.execute(self.ddl, timeout=self.timeout)

    async def check(self) -> None:
        """Connect, create the table if missing, and prove the role may use it (rights to read and write).

        Raises `BackendMisconfigured` naming the fix (`idem-asgi migrate`, the GRANT needed), or
        `BackendUnavailable` when the server cannot be reached now.
        """
        await self.setup()
        pool = await self._get_pool()
        sql = (
            "SELECT has_table_privilege($1, 'SELECT') AND has_table_privilege($1, 'INSERT') "
            "AND has_table_privilege($1, 'UPDATE') AND has_table_privilege($1, 'DELETE')"
        )
        if not await self._run(pool, "fetchval", sql, self.table):
            raise BackendMisconfigured(
                f"postgres: the role may not read and write {self.table}; fix: GRANT SELECT, INSERT, UPDATE, "
                f"DELETE ON {self.table} TO <the app's role>"
            )

    async def setup(self) -> None:
        """Create the table and indexes if missing (idempotent, safe to run from many workers at once).

        Also checks that the pool's sessions run at READ COMMITTED: under REPEATABLE READ or
        SERIALIZABLE, concurrent claims of one key fail with serialization errors (503s).
        """
        pool = await self._get_pool()
        try:
            async with pool.acquire(timeout=self.timeout) as conn:
                isolation = await conn.fetchval("SHOW default_transaction_isolation", timeout=self.timeout)
                if isolation != "read committed":
                    raise ConfigurationError(
                        f"the pool's sessions default to {isolation!r}; concurrent claims need 'read committed': "
                        "create the pool with server_settings={'default_transaction_isolation': 'read committed'}"
                    )
                await self._create(conn)
        except (*_UNAVAILABLE, asyncpg.PostgresError) as exc:
            raise _wrapped(exc, self.table) from exc

    async def _run(self, pool: Any, method: str, sql: str, *args: Any, deadline: float | None = None) -> Any:
        # One deadline for the whole call: waiting for a pooled connection, then the statement.
        # When the statement times out, asyncpg sends the server a cancel request; the connection
        # goes back to the pool in the background (bounded by `timeout`, else it is terminated),
        # so a hung server costs the caller `timeout`, not two or three times it.
        if deadline is None:
            deadline = monotonic() + self.timeout
        try:
            remaining = deadline - monotonic()
            if remaining <= 0:
                raise TimeoutError
            if self._turns is None:
                self._turns = _Turns(pool.get_max_size())
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
                return await getattr(conn, method)(sql, *args, timeout=remaining)
            except _TIMEOUT:
                release = False
                task = asyncio.get_running_loop().create_task(_release_quietly(pool, conn, turns))
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
            raise _wrapped(exc, self.table) from exc

    async def _run_again(self, pool: Any, method: str, sql: str, *args: Any) -> tuple[Any, bool]:
        """Run a statement; after a broken connection, once more on a fresh one, within one deadline.

        Returns (result, retried). A broken connection (terminated backend, server restart, reset)
        leaves it unknown whether the statement committed, so only statements that can tell their
        own earlier effect apart are run this way. Timeouts are not retried: the server may be hung.
        """
        deadline = monotonic() + self.timeout
        try:
            return await self._run(pool, method, sql, *args, deadline=deadline), False
        except BackendUnavailable as exc:
            if isinstance(exc.__cause__, _TIMEOUT):
                raise
            # What broke one connection (a restart, a mass pg_terminate_backend) usually broke the
            # idle ones too: have the pool replace them all instead of handing us the next corpse.
            await pool.expire_connections()
        return await self._run(pool, method, sql, *args, deadline=deadline), True

    async def _claim(self, key: RecordKey, fingerprint: bytes, lease: float, ttl: float, token: int) -> ClaimResult:
        pool = await self._get_pool()
        args = (key.namespace, key.scope, key.key, fingerprint, token, lease, ttl)
        for _ in range(5):
            row, _retried = await self._run_again(pool, "fetchrow", self._sql_claim, *args)
            if row is None:
                continue  # lost a race our snapshot cannot see (see _sql_claim): read again
            record = None if row[0] else _record(row)
            if record is None or (record.token == token and record.state == IN_PROGRESS):
                # (The second case is our own claim: an earlier attempt committed it and its answer
                # was lost with the connection. The token is ours alone, so the key is ours.)
                return Claimed(token)
            return Existing(record, row[10])
        raise BackendError("claim found neither a free key nor a record after 5 attempts")

    async def claim(self, key: RecordKey, fingerprint: bytes, *, lease: float, ttl: float) -> ClaimResult:
        token = new_token()
        try:
            return await self._claim(key, fingerprint, lease, ttl, token)
        except BaseException:
            # No answer, so the caller answers 503 and never runs the app, yet the INSERT may have
            # committed: without a sweep that ghost claim would block the key (409, then
            # outcome-unknown) for a whole TTL though nothing ran.
            self._orphans.add((key, token), ttl)
            raise

    async def takeover(
        self, key: RecordKey, stale_token: int, fingerprint: bytes, *, lease: float, ttl: float
    ) -> ClaimResult | None:
        # A takeover whose reply is lost is not swept: it may carry an answer the recover hook supplied.
        pool = await self._get_pool()
        token = new_token()
        args = (key.namespace, key.scope, key.key, fingerprint, token, lease, ttl, stale_token)
        for _ in range(5):
            row, _retried = await self._run_again(pool, "fetchrow", self._sql_takeover, *args)
            if row is None:
                continue  # the row changed between our snapshot and the update: read again
            if row[0] == "taken":
                return Claimed(token)
            if row[0] == "gone":
                return None
            record = _record(row)
            if record.token == token and record.state == IN_PROGRESS:
                return Claimed(token)  # our own takeover, committed before its answer was lost
            return Existing(record, row[10])
        raise BackendError("takeover found neither the claim nor a record after 5 attempts")

    async def complete(self, key: RecordKey, token: int, response: StoredResponse, *, ttl: float) -> bool:
        pool = await self._get_pool()
        args = (key.namespace, key.scope, key.key, token)
        trailers = None if response.trailers is None else _headers_encode(response.trailers)
        payload = (
            response.status,
            _headers_encode(response.headers),
            response.body,
            response.replayable,
            ttl,
            trailers,
        )
        status, retried = await self._run_again(pool, "execute", self._sql_complete, *args, *payload)
        if status == "UPDATE 1":
            return True
        if retried:
            # The first attempt may have committed before the connection broke: a record completed
            # under our token can only be our own completion.
            return bool(await self._run(pool, "fetchval", self._sql_completed_by, *args))
        return False

    async def release(self, key: RecordKey, token: int) -> bool:
        pool = await self._get_pool()
        # Safe to run twice: a second DELETE under the same token finds nothing (False, harmlessly).
        status, _ = await self._run_again(pool, "execute", self._sql_release, key.namespace, key.scope, key.key, token)
        return bool(status == "DELETE 1")

    async def extend(self, key: RecordKey, token: int, *, lease: float) -> bool:
        pool = await self._get_pool()
        status = await self._run(pool, "execute", self._sql_extend, key.namespace, key.scope, key.key, token, lease)
        return bool(status == "UPDATE 1")

    async def mark_failed(self, key: RecordKey, token: int) -> bool:
        pool = await self._get_pool()
        status, _ = await self._run_again(pool, "execute", self._sql_fail, key.namespace, key.scope, key.key, token)
        return bool(status == "UPDATE 1")

    async def checkpoint(self, step: str, *, key: RecordKey | None = None, token: int | None = None) -> None:
        """Record how far the running handler got (e.g. `"charged ch_123"`) on its claim's row.

        A recover hook or `reconcile` then sees it as `record.checkpoint` if the worker dies, and
        knows what to ask the provider. Without `key`/`token`, the claim of the request running in
        this task is used (the middleware claims in the task that runs the handler). Fenced by
        the token: raises `ClaimLost` when the claim was taken over.
        """
        if key is None or token is None:
            claim = self._live_claim()
            if claim is None:
                raise ClaimLost("checkpoint() outside a request holding a claim of this backend")
            key, token = claim.rkey, claim.token
            assert key is not None
        pool = await self._get_pool()
        status = await self._run(pool, "execute", self._sql_checkpoint, key.namespace, key.scope, key.key, token, step)
        if status != "UPDATE 1":
            raise ClaimLost(f"the claim on key {key.key!r} is no longer held; checkpoint not recorded")

    async def get(self, key: RecordKey) -> Record | None:
        pool = await self._get_pool()
        row = await self._run(pool, "fetchrow", self._sql_get, key.namespace, key.scope, key.key)
        return None if row is None else _record(row)

    async def purge(self, batch_size: int = 1000, *, max_batches: int | None = None) -> int:
        """Delete expired records, `batch_size` rows per statement; returns how many were deleted.

        Each batch is its own short autocommit statement that skips rows locked by live traffic,
        so it is safe to run while serving (from cron or a periodic task). Stops when a batch
        comes back short, or after `max_batches`.
        """
        if batch_size < 1:
            raise ValueError("batch_size must be at least 1")
        pool = await self._get_pool()
        total = 0
        batches = 0
        while max_batches is None or batches < max_batches:
            status = await self._run(pool, "execute", self._sql_purge, batch_size)
            deleted = int(status.rpartition(" ")[2])
            total += deleted
            batches += 1
            if deleted < batch_size:
                break
        return total

    async def stale(
        self, older_than: float = 0.0, limit: int = 1000, *, namespace: str | None = None
    ) -> list[StaleRecord]:
        """In-progress records whose lease ended more than `older_than` seconds ago (store clock).

        Their holder stopped between claim and completion, so their outcome is unknown: the list
        is for a reconcile job that asks the source of truth, then completes or releases them.
        Oldest first, at most `limit`; records past their TTL are not listed; `namespace` keeps
        only that namespace's records.
        """
        pool = await self._get_pool()
        rows = await self._run(pool, "fetch", self._sql_stale, float(older_than), limit, namespace)
        return [StaleRecord(RecordKey.build(row[14], row[15], row[16]), _record(row), row[1] == b"e") for row in rows]

    @contextlib.asynccontextmanager
    async def transaction(self, connection: Any = None) -> AsyncIterator[Any]:
        """A transaction whose commit also records that this request's effect happened.

        Use it in a handler behind `IdempotencyMiddleware` with this backend, for every write the
        request makes to this database::

            async with backend.transaction() as conn:
                await conn.execute("INSERT INTO ledger ...", ...)

        Just before COMMIT it marks the claim `effect committed`, fenced by the claim's token, in
        the same transaction. So the business writes and that mark commit or roll back together:
        a worker killed before COMMIT leaves nothing behind but an in-progress claim, which
        `recover_uncommitted` (as the route's `recover` hook) lets the next retry run again; a
        worker killed after COMMIT leaves a claim that is never run again. A holder whose claim
        was taken over meanwhile gets `ClaimLost` and its writes are rolled back.

        Yields an asyncpg connection from the backend's pool, or `connection` (yours, e.g. one in
        your own unit of work; the block then becomes a savepoint inside your transaction, and the
        mark commits with your COMMIT). A request that carries no key has no claim: the block is
        then a plain transaction.

        Used more than once in one request, each block commits on its own and each marks the claim
        (the claim counts as effect-committed from the first COMMIT: a failure between two blocks
        is never run again, so put what must be all-or-nothing in one block). A block nested in
        another joins it: it is a savepoint on the same connection, and only the outer block's
        COMMIT marks the claim. Nested blocks must run in the task of the outer one.
        """
        outer = _open_connection.get()
        if connection is None and outer is not None:
            async with outer.transaction():  # nested: a savepoint of the outer block, which marks
                yield outer
            return
        claim = self._live_claim()
        pool = None
        if connection is None:
            pool = await self._get_pool()
            try:
                connection = await pool.acquire(timeout=self.timeout)
            except (*_UNAVAILABLE, asyncpg.PostgresError) as exc:
                raise _wrapped(exc, self.table) from exc
        reset = _open_connection.set(connection)
        try:
            async with connection.transaction():
                yield connection
                if claim is not None:
                    k = claim.rkey
                    assert k is not None
                    status = await connection.execute(
                        self._sql_effect, k.namespace, k.scope, k.key, claim.token, timeout=self.timeout
                    )
                    if status != "UPDATE 1":
                        raise ClaimLost(
                            f"the claim on key {k.key!r} is no longer held by this request (taken over, expired "
                            "or already completed); the transaction is rolled back"
                        )
            if claim is not None:
                claim.mark_effect()  # committed: a failure from now on must not release the claim
        finally:
            _open_connection.reset(reset)
            if pool is not None:
                await pool.release(connection)

    def _live_claim(self) -> ClaimHandle | None:
        """The claim of the protected request running in this context, if it was made in this store
        and its answer is not final yet (a background task after the answer, or a keyless request,
        holds none: its transaction is a plain one)."""
        info = current_idempotency()
        claim = None if info is None else info.claim
        if claim is None:
            return None
        if not _holds(claim.backend, self):
            if isinstance(claim.backend, PostgresBackend):
                raise ConfigurationError("this request was claimed through another PostgresBackend instance")
            return None  # claimed in another kind of store: this database's transaction is a plain one
        return claim

    async def recover_uncommitted(self, key: RecordKey, record: Record) -> Literal["run"] | None:
        """A `RoutePolicy(recover=...)` hook for handlers whose every effect goes through `transaction()`.

        A claim whose holder died is re-run when its transaction never committed (nothing
        happened), and left to `outcome-unknown` when it did (the effect happened; only the answer
        was lost). The re-run takes the claim over by its old token, so it cannot race the old
        holder: if that one commits after all, the takeover fails, and the other way round.
        """
        pool = await self._get_pool()
        state = await self._run(pool, "fetchval", self._sql_holder, key.namespace, key.scope, key.key, record.token)
        return "run" if state == b"p" else None

    # -- claims whose reply was lost -------------------------------------------------------

    @property
    def pending_orphans(self) -> int:
        """Claims whose reply was lost and that are not yet known to be gone from the table."""
        return len(self._orphans)

    async def _abandon_claim(self, entry: tuple[RecordKey, int]) -> bool:
        key, token = entry
        pool = await self._get_pool()
        status = await self._run(pool, "execute", self._sql_release, key.namespace, key.scope, key.key, token)
        if status == "DELETE 1":
            logger.info("idem_asgi: removed an unanswered claim on key %r", key.key)
            return True
        return False

    async def aclose(self) -> None:
        """Stop the sweep and close the pool if `from_dsn` made it (after connections still being handed back)."""
        await self._orphans.aclose()
        if self._releasing:
            await asyncio.gather(*self._releasing, return_exceptions=True)
        if self._owned and self._pool is not None:
            pool, self._pool = self._pool, None
            await pool.close()


async def _release_quietly(pool: Any, conn: Any, turns: _Turns) -> None:
    # The pool terminates a connection it could not reset in time and re-raises; nobody waits
    # for this task, so there is nobody to tell.
    try:
        with contextlib.suppress(Exception):
            await pool.release(conn)
    finally:
        turns.give_back()


class _Turns:
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


def _record(row: Any) -> Record:
    state = row[1]
    response = None
    if state == b"c" and row[6] is not None:
        trailers = None if row[12] is None else _headers_decode(row[12])
        response = StoredResponse(row[6], _headers_decode(row[7]), row[8], row[9], trailers)
    return Record(
        COMPLETED if state == b"c" else IN_PROGRESS,
        row[2],
        row[3],
        row[4],
        row[5],
        response,
        row[11],
        effect_committed=state == b"e",
        holder_failed=state == b"u",
        ttl=row[13],
    )


async def _keep_session(connection: Any) -> None:
    """Pool reset hook that sends nothing: our statements leave no session state to reset."""
