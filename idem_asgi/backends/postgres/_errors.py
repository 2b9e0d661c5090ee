"""What an asyncpg (or socket) error means for a request: the one place a Postgres driver error
becomes the library's (misconfigured: 500 and a failed start-up; unavailable: 503; else a store error).

Every call into asyncpg runs inside `DriverErrors(table)` (`with self._runner.errors: ...`), or, on
the statement path itself (`Runner.run`), catches `CAUGHT` and raises `wrapped(...)`: the same mapping
without the 0.3 us a `with` costs.
"""

from __future__ import annotations

import asyncio
from types import TracebackType
from typing import Final

import asyncpg

from ...errors import BackendError, BackendMisconfigured, BackendUnavailable
from ._pooler import pooler_refusal

# asyncpg raises asyncio.TimeoutError, which is the builtin TimeoutError only from Python 3.11.
TIMEOUT: Final = (TimeoutError, asyncio.TimeoutError)
UNAVAILABLE: Final = (
    OSError,
    *TIMEOUT,
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
MISCONFIGURED: Final = (
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
    if isinstance(exc, MISCONFIGURED):
        return BackendMisconfigured(
            f"postgres refuses the connection ({what}); fix: check the role, password, database and schema in the DSN"
        )
    if isinstance(exc, asyncpg.ReadOnlySQLTransactionError):
        return BackendUnavailable(f"postgres is read-only (a standby, or a failover in progress): {what}")
    if isinstance(exc, UNAVAILABLE):
        return BackendUnavailable(f"postgres unavailable: {exc!r}")
    return BackendError(f"postgres error: {exc!r}")


CAUGHT: Final = (*UNAVAILABLE, asyncpg.PostgresError)
"""What `DriverErrors` turns into a `BackendError`; any other exception passes unchanged."""


class DriverErrors:
    """A context manager raising `wrapped(exc, table)` for a driver error inside it.

    A class, not `contextlib.contextmanager`: it sits on every statement's path, and is reentrant
    (no state but the table), so one instance serves a backend.
    """

    __slots__ = ("table",)

    def __init__(self, table: str) -> None:
        self.table = table

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if isinstance(exc, CAUGHT):
            raise wrapped(exc, self.table) from exc
