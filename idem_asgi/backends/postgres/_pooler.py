"""What `PostgresBackend` learns about its connections once, before it serves: a pooler between it
and the server, and the sessions' default isolation level.

A transaction-mode pooler (PgBouncer, pgcat, Supavisor, Odyssey) hands each transaction whichever
server connection is free, so asyncpg's named prepared statements, made on one server connection,
are missing on the next ("prepared statement ... does not exist"). Such a pooler answers the
connection itself and so sends its own cancel key: the backend pid asyncpg was told at connect
differs from `pg_backend_pid()`. Seen once at start-up, the pool is built with
`statement_cache_size=0` (asyncpg then sends each statement's Parse with its Bind, in one message).

The claim needs READ COMMITTED (under REPEATABLE READ a losing claimer gets 40001). That is
Postgres' default; a server, role or database that defaults to another level gets each statement
run in an explicit `READ COMMITTED` transaction instead of a startup parameter, which PgBouncer
refuses ("unsupported startup parameter").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Final

import asyncpg

from ...errors import BackendMisconfigured
from ._lean import POOL_ONLY

STATEMENT_POOLING: Final = "statement pooling"
"""In PgBouncer's refusal of a transaction block: "transaction blocks not allowed in statement pooling mode"."""


@dataclass(frozen=True)
class Probe:
    pooled: bool
    """Connections reach the server through a pooler (the connect's backend pid is not the server's)."""
    isolation: str
    """The sessions' `default_transaction_isolation`."""


async def probe(conn: Any, timeout: float) -> Probe:
    """What one connection says about the pool (one round trip)."""
    pid, isolation = await conn.fetchrow(
        "SELECT pg_backend_pid(), current_setting('default_transaction_isolation')", timeout=timeout
    )
    return Probe(pid != conn.get_server_pid(), str(isolation))


async def probe_dsn(dsn: str, options: dict[str, Any], timeout: float) -> Probe:
    """`probe` on a connection of its own (without a statement cache: it may go through a pooler)."""
    conn = await asyncpg.connect(dsn, **{"timeout": timeout, **connect_options(options), "statement_cache_size": 0})
    try:
        return await probe(conn, timeout)
    finally:
        await conn.close(timeout=timeout)


_POOL: Final = POOL_ONLY | {"min_size", "max_size", "reset"}


def connect_options(options: dict[str, Any]) -> dict[str, Any]:
    """The `asyncpg.connect` options among a pool's options."""
    return {k: v for k, v in options.items() if k not in _POOL}


async def try_a_transaction(conn: Any, timeout: float) -> None:
    """Open and commit an empty transaction block: a pooler in `pool_mode = statement` refuses it
    (`pooler_refusal` names the fix), and `transaction()`, the table's set-up and claims on a
    server that is not READ COMMITTED by default need one."""
    async with conn.transaction():
        await conn.execute("SELECT 1", timeout=timeout)


def pooler_refusal(exc: BaseException) -> BackendMisconfigured | None:
    """A pooler's refusal that no retry can cure, as the error naming the fix; None for any other error."""
    text = str(exc)
    if STATEMENT_POOLING in text:
        return BackendMisconfigured(
            f"postgres: the pooler refuses transaction blocks ({text}), which PostgresBackend.transaction(), "
            "recover_uncommitted and the table's set-up need; fix: set pool_mode = transaction (or session) "
            "for this database in pgbouncer.ini"
        )
    if "unsupported startup parameter" in text:
        return BackendMisconfigured(
            f"postgres: the pooler refuses a connection option ({text}); fix: drop it from server_settings, "
            "or list it in pgbouncer.ini's ignore_startup_parameters"
        )
    return None
