"""PostgreSQL store on asyncpg: one statement to claim-or-read, fenced UPDATE/DELETE after it.

The claim is `INSERT ... ON CONFLICT DO UPDATE ... WHERE <expired>` in a CTE, followed by a
read of the existing row in the same statement, so a new key and a replay each cost one round
trip and an expired row is taken over atomically, never by delete-then-insert. Times are the
server's `now()`. The body is kept verbatim as `bytea`.
"""

from __future__ import annotations

import random
import re
from types import TracebackType
from typing import Any, Final

import anyio
import msgspec

from ..errors import BackendError, BackendUnavailable, ConfigurationError
from ..records import COMPLETED, IN_PROGRESS, Claimed, ClaimResult, Existing, Record, RecordKey, StoredResponse

try:
    import asyncpg
except ImportError as exc:  # pragma: no cover - exercised only without the extra
    raise ImportError("PostgresBackend needs asyncpg: pip install 'idem-asgi[postgres]'") from exc

_IDENT: Final = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,62}")
_headers_encode = msgspec.msgpack.Encoder().encode
_headers_decode = msgspec.msgpack.Decoder(list[tuple[bytes, bytes]]).decode

DDL: Final = """\
CREATE TABLE IF NOT EXISTS {table} (
    namespace   text        NOT NULL,
    scope       text        NOT NULL,
    key         text        NOT NULL,
    state       "char"      NOT NULL,            -- 'p' in progress, 'c' completed
    fingerprint bytea       NOT NULL,
    token       bigint      NOT NULL,            -- fencing token of the current holder
    lease_until timestamptz NOT NULL,
    expires_at  timestamptz NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now(),
    status      integer,
    headers     bytea,                           -- msgpack list of [name, value] byte pairs, in order
    body        bytea,                           -- response body, verbatim
    replayable  boolean,
    PRIMARY KEY (namespace, scope, key)
);
CREATE INDEX IF NOT EXISTS {index_prefix}_expires_idx ON {table} (expires_at);
CREATE INDEX IF NOT EXISTS {index_prefix}_stale_idx ON {table} (lease_until) WHERE state = 'p';
"""

_COLUMNS: Final = (
    "state, fingerprint, token, extract(epoch from lease_until)::float8, extract(epoch from expires_at)::float8, "
    "status, headers, body, replayable, extract(epoch from now())::float8"
)


class PostgresBackend:
    """Idempotency records in a PostgreSQL table through an asyncpg pool.

    Args:
        pool: An `asyncpg.Pool`; it stays yours (`aclose()` closes only a pool built by `from_dsn`).
        table: Table name, optionally `schema.table`.
        timeout: Bound in seconds on acquiring a connection and on each statement.
    """

    def __init__(self, pool: Any = None, *, table: str = "idem_records", timeout: float = 5.0) -> None:
        parts = table.split(".")
        if len(parts) > 2 or not all(_IDENT.fullmatch(p) for p in parts):
            raise ConfigurationError(f"invalid table name {table!r}")
        self.table = ".".join(f'"{p}"' for p in parts)
        self._index_prefix = parts[-1]
        self.timeout = timeout
        self._pool = pool
        self._dsn: str | None = None
        self._pool_options: dict[str, Any] = {}
        self._owned = False
        self._lock = anyio.Lock()
        t = self.table
        self._sql_claim = f"""
WITH ins AS (
    INSERT INTO {t} AS r (namespace, scope, key, state, fingerprint, token, lease_until, expires_at)
    VALUES ($1, $2, $3, 'p', $4, $5, now() + $6::float8 * interval '1 second', now() + $7::float8 * interval '1 second')
    ON CONFLICT (namespace, scope, key) DO UPDATE SET
        state = 'p', fingerprint = EXCLUDED.fingerprint, token = EXCLUDED.token,
        lease_until = EXCLUDED.lease_until, expires_at = EXCLUDED.expires_at, created_at = now(),
        status = NULL, headers = NULL, body = NULL, replayable = NULL
    WHERE r.expires_at <= now() OR (r.state = 'p' AND r.token = $8 AND r.lease_until <= now())
    RETURNING true AS claimed
)
SELECT true, NULL::"char", NULL::bytea, NULL::bigint, NULL::float8, NULL::float8,
       NULL::integer, NULL::bytea, NULL::bytea, NULL::boolean, NULL::float8 FROM ins
UNION ALL
SELECT false, {_COLUMNS} FROM {t}
WHERE namespace = $1 AND scope = $2 AND key = $3 AND NOT EXISTS (SELECT 1 FROM ins)
"""
        where = "namespace = $1 AND scope = $2 AND key = $3 AND token = $4 AND state = 'p'"
        self._sql_complete = f"""
UPDATE {t} SET state = 'c', status = $5, headers = $6, body = $7, replayable = $8,
    lease_until = now(), expires_at = now() + $9::float8 * interval '1 second'
WHERE {where}"""
        self._sql_release = f"DELETE FROM {t} WHERE {where}"
        self._sql_extend = f"""
UPDATE {t} SET lease_until = greatest(lease_until, now() + $5::float8 * interval '1 second') WHERE {where}"""
        self._sql_get = f"""
SELECT false, {_COLUMNS} FROM {t} WHERE namespace = $1 AND scope = $2 AND key = $3 AND expires_at > now()"""

    @classmethod
    def from_dsn(
        cls, dsn: str, *, table: str = "idem_records", timeout: float = 5.0, **pool_options: Any
    ) -> PostgresBackend:
        """A backend that creates (and owns) its pool on first use, and its table if missing."""
        backend = cls(table=table, timeout=timeout)
        backend._dsn = dsn
        backend._pool_options = {"min_size": 2, "max_size": 20, **pool_options}
        backend._owned = True
        return backend

    @property
    def ddl(self) -> str:
        """The schema as SQL text, for migration tools."""
        return DDL.format(table=self.table, index_prefix=self._index_prefix)

    async def __aenter__(self) -> PostgresBackend:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def _get_pool(self) -> Any:
        if self._pool is not None:
            return self._pool
        async with self._lock:
            if self._pool is None:
                if self._dsn is None:
                    raise ConfigurationError("PostgresBackend needs a pool or PostgresBackend.from_dsn(dsn)")
                try:
                    with anyio.fail_after(self.timeout):
                        pool = await asyncpg.create_pool(self._dsn, **self._pool_options)
                except (OSError, TimeoutError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
                    raise BackendUnavailable(f"postgres unavailable: {exc}") from exc
                try:
                    async with pool.acquire() as conn:
                        await conn.execute(self.ddl)
                except BaseException:
                    await pool.close()
                    raise
                self._pool = pool
        return self._pool

    async def setup(self) -> None:
        """Create the table and indexes if missing (idempotent)."""
        pool = await self._get_pool()
        await self._run(pool, "execute", self.ddl)

    async def _run(self, pool: Any, method: str, sql: str, *args: Any) -> Any:
        try:
            async with pool.acquire(timeout=self.timeout) as conn:
                return await getattr(conn, method)(sql, *args, timeout=self.timeout)
        except (
            OSError,
            TimeoutError,
            asyncpg.InterfaceError,
            asyncpg.PostgresConnectionError,
            asyncpg.exceptions.OperatorInterventionError,
            asyncpg.exceptions.CannotConnectNowError,
        ) as exc:
            raise BackendUnavailable(f"postgres unavailable: {exc!r}") from exc
        except asyncpg.PostgresError as exc:
            raise BackendError(f"postgres error: {exc!r}") from exc

    async def _claim(
        self, key: RecordKey, fingerprint: bytes, stale: int | None, lease: float, ttl: float
    ) -> ClaimResult:
        pool = await self._get_pool()
        token = random.getrandbits(62) + 1
        args = (key.namespace, key.scope, key.key, fingerprint, token, lease, ttl, stale)
        for _ in range(5):
            row = await self._run(pool, "fetchrow", self._sql_claim, *args)
            if row is None:
                continue  # a concurrent insert committed after our snapshot: read again
            if row[0]:
                return Claimed(token)
            return Existing(_record(row), row[10])
        raise BackendError("claim found neither a free key nor a record after 5 attempts")

    async def claim(self, key: RecordKey, fingerprint: bytes, *, lease: float, ttl: float) -> ClaimResult:
        return await self._claim(key, fingerprint, None, lease, ttl)

    async def takeover(
        self, key: RecordKey, stale_token: int, fingerprint: bytes, *, lease: float, ttl: float
    ) -> ClaimResult:
        return await self._claim(key, fingerprint, stale_token, lease, ttl)

    async def complete(self, key: RecordKey, token: int, response: StoredResponse, *, ttl: float) -> bool:
        pool = await self._get_pool()
        status = await self._run(
            pool,
            "execute",
            self._sql_complete,
            key.namespace,
            key.scope,
            key.key,
            token,
            response.status,
            _headers_encode(response.headers),
            response.body,
            response.replayable,
            ttl,
        )
        return bool(status == "UPDATE 1")

    async def release(self, key: RecordKey, token: int) -> bool:
        pool = await self._get_pool()
        status = await self._run(pool, "execute", self._sql_release, key.namespace, key.scope, key.key, token)
        return bool(status == "DELETE 1")

    async def extend(self, key: RecordKey, token: int, *, lease: float) -> bool:
        pool = await self._get_pool()
        status = await self._run(pool, "execute", self._sql_extend, key.namespace, key.scope, key.key, token, lease)
        return bool(status == "UPDATE 1")

    async def get(self, key: RecordKey) -> Record | None:
        pool = await self._get_pool()
        row = await self._run(pool, "fetchrow", self._sql_get, key.namespace, key.scope, key.key)
        return None if row is None else _record(row)

    async def aclose(self) -> None:
        """Close the pool if `from_dsn` made it."""
        if self._owned and self._pool is not None:
            pool, self._pool = self._pool, None
            await pool.close()


def _record(row: Any) -> Record:
    response = None
    if row[1] == b"c" and row[6] is not None:
        response = StoredResponse(row[6], _headers_decode(row[7]), row[8], row[9])
    return Record(COMPLETED if row[1] == b"c" else IN_PROGRESS, row[2], row[3], row[4], row[5], response)
