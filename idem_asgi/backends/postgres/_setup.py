"""The base of `PostgresBackend`: its pool and table. The pool is made on first use (the
implementation `from_dsn` names, after asking one connection about poolers and isolation), the
table with it if missing; `check()` proves both at start-up; `ddl`, `setup()`, `may_alter()` and
the raw-key record serve `idem-asgi migrate`. Never on a request's path but for `_get_pool`."""

from __future__ import annotations

from types import ModuleType
from typing import Any, ClassVar

import anyio
import asyncpg

from ...errors import BackendMisconfigured, BackendUnavailable, ConfigurationError
from .._base import RawKeyRecord
from . import _keys
from ._history import DDL as HISTORY_DDL
from ._lean import LeanPool
from ._pool import Runner, keep_session
from ._pooler import probe, probe_dsn, try_a_transaction
from ._sql import DDL


class Setup(RawKeyRecord):
    """Set up by `PostgresBackend.__init__` and `from_dsn`; a class of its own to keep this half apart."""

    table: str
    _timeout: float
    _indexes: dict[str, str]
    _relations: list[str]
    _history_relations: list[str]
    history: int
    history_table: str
    _pool: Any
    _dsn: str | None
    _pool_options: dict[str, Any]
    _create_table: bool
    _lean: bool
    _lock: anyio.Lock
    _runner: Runner
    _raw_recorded: bool
    _closed: bool = False
    _pooled: bool
    _key_forms: ClassVar[ModuleType] = _keys

    @property
    def timeout(self) -> float:
        """Seconds each store call may take, waiting for a pooled connection included."""
        return self._timeout

    @timeout.setter
    def timeout(self, value: float) -> None:
        self._timeout = self._runner.timeout = value

    @property
    def ddl(self) -> str:
        """The schema as SQL text, for migration tools."""
        return DDL.format(table=self.table, **self._indexes) + HISTORY_DDL.format(
            history=self.history_table, **self._indexes
        )

    async def _get_pool(self) -> Any:
        if self._pool is not None:
            return self._pool
        if self._closed:  # aclose() closed the pool it made: nothing opens another
            raise BackendUnavailable("postgres: this backend was closed (aclose()); build a new one")
        if self._dsn is None:
            raise ConfigurationError("PostgresBackend needs a pool or PostgresBackend.from_dsn(dsn)")
        # The wait for another request's attempt counts against this request's timeout: with the
        # server hung, the tenth caller would otherwise wait ten timeouts.
        try:
            with self._runner.errors, anyio.fail_after(self.timeout):
                async with self._lock:
                    if self._pool is None:
                        self._pool = await self._new_pool(self._dsn)
        except ValueError as exc:  # an unparseable DSN (asyncpg's ClientConfigurationError is one too)
            raise BackendMisconfigured(f"postgres: invalid DSN: {exc}") from exc
        return self._pool

    async def _new_pool(self, dsn: str) -> Any:
        """The pool `from_dsn`'s `implementation` names, with the table made if asked."""
        options = await self._probed_options()
        pool: Any
        if self._lean:
            pool = await LeanPool(dsn, **options).start()
        else:
            pool = await asyncpg.create_pool(dsn, **{"reset": keep_session, **options})
        try:
            if self._create_table:
                async with pool.acquire() as conn:
                    await self._create(conn)
        except BaseException:
            pool.terminate()
            raise
        return pool

    async def _probed_options(self) -> dict[str, Any]:
        """The pool's options, after asking one connection what it goes through (see `from_dsn`)."""
        assert self._dsn is not None
        found = await probe_dsn(self._dsn, self._pool_options, self.timeout)
        self._runner.isolate = found.isolation != "read committed"
        self._pooled = found.pooled  # LISTEN cannot work through it (see _notices.py)
        if found.pooled:
            return {"statement_cache_size": 0, **self._pool_options}
        return self._pool_options

    async def _create(self, conn: Any) -> None:
        relations = [*self._relations, *(self._history_relations if self.history else [])]
        exists = "SELECT " + " AND ".join(f"to_regclass(${i}) IS NOT NULL" for i in range(1, len(relations) + 1))
        # (and the newest column: tables made by earlier releases get it from the DDL's ALTER)
        exists += (
            " AND (SELECT count(*) FROM pg_attribute WHERE attrelid = to_regclass($1)"
            " AND attname IN ('watched', 'sealed_key', 'kept_until', 'kept')) = 4"
        )
        if await conn.fetchval(exists, *relations, timeout=self.timeout):
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

        Raises `BackendMisconfigured` naming the fix (`idem-asgi migrate`, the GRANT needed, a
        pooler's setting), or `BackendUnavailable` when the server cannot be reached now.
        """
        await self.setup()
        pool = await self._get_pool()
        with self._runner.errors:
            async with pool.acquire(timeout=self.timeout) as conn:
                await try_a_transaction(conn, self.timeout)  # PgBouncer's statement mode refuses it
        sql = (
            "SELECT has_table_privilege($1, 'SELECT') AND has_table_privilege($1, 'INSERT') "
            "AND has_table_privilege($1, 'UPDATE') AND has_table_privilege($1, 'DELETE')"
        )
        if not await self._runner.run(pool, "fetchval", sql, self.table):
            raise BackendMisconfigured(
                f"postgres: the role may not read and write {self.table}; fix: GRANT SELECT, INSERT, UPDATE, "
                f"DELETE ON {self.table} TO <the app's role>"
            )

    async def may_alter(self) -> bool:
        """Whether this role owns the table (or is a member of its owner): only then can it run a
        later version's `ALTER TABLE`; `idem-asgi migrate` says so when it cannot."""
        sql = "SELECT pg_has_role(current_user, relowner, 'USAGE') FROM pg_class WHERE oid = to_regclass($1)"
        return bool(await self._runner.run(await self._get_pool(), "fetchval", sql, self.table))

    async def setup(self) -> None:
        """Create the table and indexes if missing (idempotent, safe to run from many workers at once).

        Also asks which isolation level the pool's sessions default to: under REPEATABLE READ or
        SERIALIZABLE, concurrent claims of one key would fail with serialization errors, so each
        statement then runs in a READ COMMITTED transaction.
        """
        pool = await self._get_pool()
        with self._runner.errors:
            async with pool.acquire(timeout=self.timeout) as conn:
                self._runner.isolate = (await probe(conn, self.timeout)).isolation != "read committed"
                await self._create(conn)

    async def hash_stored_keys(self, batch_size: int = 1000) -> tuple[int, int]:
        """Rewrite rows that hold a raw scope and key (written by 0.1.0, or by `store_keys=True`) to
        the digest alone, in batches of short statements; `idem-asgi migrate` runs it. Rewrites
        nothing while an app with `store_keys=True` is recorded in the table (`raw_keys_recorded`),
        so it never hides a row from an app that looks it up raw. Returns (rewritten, left): a row
        whose digest row already exists (claimed again by a newer version meanwhile) is left as it
        is, to expire with its TTL."""
        return await _keys.hash_stored_keys(self, batch_size)
