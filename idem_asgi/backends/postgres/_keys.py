"""Which form of key a `PostgresBackend` table's apps look their rows up by, and `idem-asgi migrate`'s rewrite.

A row holds either the raw scope and key (an app with `store_keys=True`, or a row of 0.1.0) or only
the key's digest (`scope` empty, `key` = `\\x1f<digest>`, the default). An app with `store_keys=True`
records so in the table itself, in one settings row, before it writes its first row (its role needs
no right beyond the four it has); `migrate` follows that record and never rewrites a raw row such
an app still looks up, so running it at every deploy never hides a record from a live app. Each
rewrite re-checks the record in the same statement, so an app that starts while `migrate` runs
stops the rewrite before its rows are touched.
"""

from __future__ import annotations

from typing import Any, Final, Protocol

import asyncpg

from ...records import RecordKey
from ._pool import Runner


class Table(Protocol):
    """What these tools use of a `PostgresBackend`: passed in by the store, so they never import it."""

    table: str
    timeout: float
    _runner: Runner

    async def _get_pool(self) -> Any: ...


HASHED: Final = "\x1f"
"""Marks a `key` column holding a digest: no raw key starts with it (header keys are visible ASCII,
derived keys start with their method)."""
RAW_KEYS: Final = "\x1fstore_keys"
"""The settings row's key (namespace and scope empty): never a digest (`\\x1f` + 64 hex) nor a raw key.
Completed and never expiring, so neither `stale()` nor `purge()` sees it."""

_MARK: Final = "namespace = '' AND scope = '' AND key = $1"


async def record_raw_keys(backend: Table) -> None:
    """Record that an app looks rows up by their raw keys (`store_keys=True`); when, as `lease_until`."""
    pool = await backend._get_pool()
    await backend._runner.run(
        pool,
        "execute",
        f"INSERT INTO {backend.table} (namespace, scope, key, state, fingerprint, token, lease_until, expires_at) "
        "VALUES ('', '', $1, 'c', '', 0, now(), 'infinity') "
        "ON CONFLICT (namespace, scope, key) DO UPDATE SET lease_until = now()",
        RAW_KEYS,
    )


async def raw_keys_recorded(backend: Table) -> float | None:
    """When an app with `store_keys=True` last recorded that it uses the table (store clock), or None."""
    pool = await backend._get_pool()
    since: float | None = await backend._runner.run(
        pool,
        "fetchval",
        f"SELECT extract(epoch from lease_until)::float8 FROM {backend.table} WHERE {_MARK}",
        RAW_KEYS,
    )
    return since


async def forget_raw_keys(backend: Table) -> None:
    """Drop that record (`migrate --no-store-keys`, once no worker with `store_keys=True` runs)."""
    pool = await backend._get_pool()
    await backend._runner.run(pool, "execute", f"DELETE FROM {backend.table} WHERE {_MARK}", RAW_KEYS)


async def hash_stored_keys(backend: Table, batch_size: int) -> tuple[int, int]:
    """See `PostgresBackend.hash_stored_keys`."""
    pool = await backend._get_pool()
    t, timeout = backend.table, backend.timeout
    rewritten = left = 0
    last = ("", "", "")
    select = (
        f"SELECT namespace, scope, key FROM {t} WHERE left(key, 1) <> $4 "
        "AND (namespace, scope, key) > ($1, $2, $3) ORDER BY namespace, scope, key LIMIT $5"
    )
    # The settings row is read by the UPDATE itself (READ COMMITTED: the newest committed state), so
    # a raw row written after an app recorded raw keys is never rewritten.
    update = (
        f"UPDATE {t} SET scope = '', key = $4 WHERE namespace = $1 AND scope = $2 AND key = $3 "
        f"AND NOT EXISTS (SELECT 1 FROM {t} WHERE namespace = '' AND scope = '' AND key = $5)"
    )
    with backend._runner.errors:
        async with pool.acquire(timeout=timeout) as conn:
            while True:
                rows = await conn.fetch(select, *last, HASHED, batch_size, timeout=timeout)
                if not rows:
                    return rewritten, left
                for namespace, scope, key in rows:
                    digest = RecordKey.build(namespace, scope, key).digest
                    try:
                        status = await conn.execute(
                            update, namespace, scope, key, HASHED + digest, RAW_KEYS, timeout=timeout
                        )
                    except asyncpg.UniqueViolationError:
                        left += 1
                        continue
                    if status == "UPDATE 1":
                        rewritten += 1
                    elif await _recorded(conn, t, timeout):
                        return rewritten, left  # an app keeping raw keys started meanwhile: stop
                last = tuple(rows[-1])


async def _recorded(conn: Any, table: str, timeout: float) -> bool:
    return bool(await conn.fetchval(f"SELECT true FROM {table} WHERE {_MARK}", RAW_KEYS, timeout=timeout))
