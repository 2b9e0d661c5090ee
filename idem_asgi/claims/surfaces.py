"""Which surface a record belongs to, and the answers each surface's records take.

A record is made by one of three surfaces: an HTTP request (its answer is a response a client got),
a job (`@idempotent`, `claim`: its answer is the function's result), or a message (a consumer
adapter: its answer is the handler's result). The record says which through its fingerprint: a
job's and a message's carry a short prefix (`JOB`, `MESSAGE`), an HTTP request's none. So every
store keeps it as it keeps the fingerprint, with no field of its own.

`check_answer` is asked before any answer is written for a record from outside its own run (a
recover hook, `reconcile`, the CLI): an HTTP answer on a job's record (or a job result on a
request's) would be replayed to callers that cannot read it, so it is refused with a message that
says what to return. A job's result is also checked against its function's return annotation when
the function is known in this process (`expect_results`, registered by `@idempotent`).
"""

from __future__ import annotations

from typing import Any, Final, Literal

import msgspec

from ..errors import WrongAnswer
from ..records import JOB_MARK, Record, RecordKey, StoredResponse

JOB: Final = b"\x00job:"
"""The prefix of a job's fingerprint."""
MESSAGE: Final = b"\x00msg:"
"""The prefix of a message's fingerprint."""
Surface = Literal["http", "job", "message"]

_results: dict[str, Any] = {}
"""A job namespace -> its function's return annotation (registered at decoration)."""


def surface_of(fingerprint: bytes) -> Surface:
    """The surface whose claim stored this fingerprint."""
    if fingerprint.startswith(JOB):
        return "job"
    if fingerprint.startswith(MESSAGE):
        return "message"
    return "http"


def legacy_match(stored: bytes, given: bytes) -> bool:
    """A record claimed before fingerprints carried their surface (a bare digest) matches the same
    digest with its prefix: a message redelivered across the upgrade is still the same message."""
    return len(given) == len(stored) + len(JOB) and given[: len(JOB)] in (JOB, MESSAGE) and given.endswith(stored)


def expect_results(namespace: str, returns: Any) -> None:
    """Answers for the jobs of `namespace` must decode as `returns` (Any: anything msgpack)."""
    _results[namespace] = returns


def check_answer(key: RecordKey, record: Record, answer: StoredResponse) -> None:
    """Refuse `answer` for `record` when it is of the wrong kind or shape (`WrongAnswer`)."""
    surface = surface_of(record.fingerprint)
    is_result = JOB_MARK in answer.headers
    if surface == "http":
        if is_result:
            raise WrongAnswer(
                f"key {key.key!r} is an HTTP request's record, and this answer is a job result "
                "(stored_result): return a StoredResponse(status, headers, body) as its client should have got it"
            )
        return
    if not is_result:
        raise WrongAnswer(
            f"key {key.key!r} is a {surface}'s record, and this answer is an HTTP response: return the "
            f"{surface}'s result as the job stores it, `stored_result(value)` (or `<job>.stored_result(value)`, "
            "which checks it against the job's return type)"
        )
    returns = _results.get(key.namespace, Any)
    if returns is Any:
        return
    try:
        msgspec.msgpack.decode(answer.body, type=returns)
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise WrongAnswer(
            f"key {key.key!r}: this result does not decode as the job's return type {_named(returns)} ({exc}); "
            f"return `<job>.stored_result(value)` with a value of that type"
        ) from None


def _named(returns: Any) -> str:
    return getattr(returns, "__qualname__", None) or repr(returns)
