"""What a redis-py error means for a request: the store is misconfigured (500, and a failed
start-up), unavailable (503: the command may or may not have run), or failed otherwise.

The one place a Redis driver error becomes the library's: every call runs inside `DRIVER_ERRORS`,
or, on the script-call path itself (`RedisBackend._call`), catches `CAUGHT` and raises `wrapped(exc)`:
the same mapping without the 0.3 us a `with` costs.
"""

from __future__ import annotations

from types import TracebackType
from typing import Final

from redis import exceptions as redis_errors
from redis.asyncio.sentinel import MasterNotFoundError
from redis.sentinel import MasterNotFoundError as SyncMasterNotFoundError

from ...errors import BackendError, BackendMisconfigured, BackendUnavailable

# Errors that mean "Redis did not answer (in time)": the command may or may not have run.
UNAVAILABLE: Final = (
    redis_errors.ConnectionError,  # includes pool exhaustion (MaxConnectionsError) and LOADING
    redis_errors.TimeoutError,
    redis_errors.ClusterDownError,
    redis_errors.TryAgainError,
    redis_errors.SlotNotCoveredError,
    redis_errors.ReadOnlyError,  # a replica answered: failover in progress
    TimeoutError,
    OSError,
)


# The store answers, but refuses us for good: retrying cannot help (500, and a failed start-up).
MISCONFIGURED: Final = (
    redis_errors.AuthenticationError,
    redis_errors.AuthorizationError,
    redis_errors.AuthenticationWrongNumberOfArgsError,
    redis_errors.NoPermissionError,
)
_MISCONFIGURED_TEXT: Final = ("DB index is out of range", "unknown command", "NOSCRIPT No matching script")
# How a server that wants a password answers a client that sent none (the lean pool sees these as
# plain error replies; Redis 7 refuses an unauthenticated client's long command as a protocol error).
_AUTH_TEXT: Final = ("NOAUTH", "WRONGPASS", "Protocol error: unauthenticated")


def wrapped(exc: BaseException) -> BackendError:
    """The library error for a redis-py error: misconfigured, unavailable, or another store error."""
    what = f"{type(exc).__name__}: {exc}"
    if isinstance(
        exc, (MasterNotFoundError, SyncMasterNotFoundError)
    ):  # its text goes on with the repr of every sentinel client
        named = str(exc).split(" : ", 1)[0]  # "No master found for 'mymaster'"
        return BackendUnavailable(f"redis unavailable: {named} (no sentinel answered, or none knows its primary)")
    if isinstance(exc, MISCONFIGURED) or (
        isinstance(exc, redis_errors.ResponseError) and any(t in str(exc) for t in _AUTH_TEXT)
    ):
        fix = (
            "give the Redis user the scripting and hash commands on the backend's keys "
            "(ACL SETUSER <user> on ~idem:* +@scripting +@hash +@keyspace +time)"
            if isinstance(exc, redis_errors.NoPermissionError)
            else "check the username and password in the Redis URL"
        )
        return BackendMisconfigured(f"redis refuses the connection or command ({what}); fix: {fix}")
    if isinstance(exc, redis_errors.ResponseError) and any(t in str(exc) for t in _MISCONFIGURED_TEXT):
        return BackendMisconfigured(
            f"redis refuses the command ({what}); check the database number and that "
            "EVALSHA and SCRIPT LOAD are enabled"
        )
    if isinstance(exc, UNAVAILABLE):
        return BackendUnavailable(f"redis unavailable: {what}")
    return BackendError(f"redis error: {what}")


CAUGHT: Final = (*UNAVAILABLE, redis_errors.RedisError)
"""What `DRIVER_ERRORS` turns into a `BackendError`; any other exception passes unchanged."""


def retried(exc: BaseException) -> bool:
    """A dropped connection, tried once more at once on a fresh one (as redis-py's `Retry` does);
    not a refusal, which would only be refused again."""
    return isinstance(exc, redis_errors.ConnectionError) and not isinstance(exc, MISCONFIGURED)


class DriverErrors:
    """A context manager raising `wrapped(exc)` for a driver error inside it; stateless, so one
    instance (`DRIVER_ERRORS`) serves every call (a class: it sits on every call's path)."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if isinstance(exc, CAUGHT):
            raise wrapped(exc) from exc


DRIVER_ERRORS: Final = DriverErrors()
