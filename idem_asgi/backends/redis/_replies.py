"""What the scripts answer, read: a record reply (`{flag, now, s, f, t, l, e, r, x}`, see `_scripts`)
as a `Record`, and an error reply as the redis-py exception its own parser raises.

For errors, redis-py maps the reply's first word (and, for `ERR`, the whole text) to an exception class in
`redis._parsers.base.BaseParser`, a private module. The lean pool needs the same classes, since the
error mapping (`_errors`) judges them: this table holds the replies a script call can meet.
"""

from __future__ import annotations

from typing import Any, Final

from redis import exceptions as redis_errors

from ...records import COMPLETED, IN_PROGRESS, Record, decode_response

_BY_CODE: Final[dict[str, type[redis_errors.RedisError]]] = {
    "OOM": redis_errors.OutOfMemoryError,
    "WRONGPASS": redis_errors.AuthenticationError,
    "NOAUTH": redis_errors.AuthenticationError,
    "NOPERM": redis_errors.NoPermissionError,
    "EXECABORT": redis_errors.ExecAbortError,
    "LOADING": redis_errors.BusyLoadingError,  # a ConnectionError: the server is starting (503)
    "NOSCRIPT": redis_errors.NoScriptError,
    "READONLY": redis_errors.ReadOnlyError,  # a replica answered: failover in progress (503)
    "MASTERDOWN": redis_errors.MasterDownError,
    "TRYAGAIN": redis_errors.TryAgainError,
    "CLUSTERDOWN": redis_errors.ClusterDownError,
    "MOVED": redis_errors.MovedError,
    "ASK": redis_errors.AskError,
    "CROSSSLOT": redis_errors.ClusterCrossSlotError,
}
_ERR: Final[dict[str, type[redis_errors.RedisError]]] = {
    "max number of clients reached": redis_errors.ConnectionError,
    "invalid password": redis_errors.AuthenticationError,
    "wrong number of arguments for 'auth' command": redis_errors.AuthenticationWrongNumberOfArgsError,
    "wrong number of arguments for 'AUTH' command": redis_errors.AuthenticationWrongNumberOfArgsError,
    "Client sent AUTH, but no password is set": redis_errors.AuthenticationError,
}


def error(reply: Exception) -> Exception:
    """The exception for an error reply (`hiredis.ReplyError`): redis-py's class, redis-py's message."""
    text = str(reply)
    code, _, rest = text.partition(" ")
    if code == "ERR":
        return _ERR.get(rest, redis_errors.ResponseError)(rest)
    found = _BY_CODE.get(code)
    return redis_errors.ResponseError(text) if found is None else found(rest)


def record(reply: list[Any]) -> Record:
    """The record in a script's reply (flag and Redis time first)."""
    _, _, state, fingerprint, token, lease_until, expires_at, blob, ttl = reply
    return Record(
        COMPLETED if state == b"c" else IN_PROGRESS,
        fingerprint,
        int(token),
        int(lease_until) / 1000,
        int(expires_at) / 1000,
        decode_response(blob) if blob else None,
        holder_failed=state == b"u",
        ttl=None if ttl is None else int(ttl) / 1000,
    )
