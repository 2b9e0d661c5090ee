"""Resolving an expired claim: the one algorithm behind the middleware's `recover` hook (and
`on_expired="reclaim"`) and `reconcile`.

Every write is fenced by the token the caller read. A claim whose effect committed (Postgres
`transaction()`) is never taken over (that could run the effect again): its answer goes under the
holder's own token, and only while the claim is still exactly as read. Any other claim is taken
over first, which the store grants only while that token still holds and its lease is still over
(store clock), fencing the old holder out for good should it wake up; only then is the outcome
written, under the new token.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Literal, TypeAlias

from ..records import IN_PROGRESS, Claimed, ClaimResult, Record, RecordKey, StoredResponse
from .surfaces import check_answer

if TYPE_CHECKING:
    from ..backends import Backend

Outcome: TypeAlias = StoredResponse | Literal["release", "run"]
"""What happened: this answer; `"release"` (never happened: free the key); `"run"` (never happened:
take the claim over and run it here)."""

RecoverHook: TypeAlias = Callable[[RecordKey, Record], Awaitable["StoredResponse | Literal['run'] | None"]]
"""A surface's `recover=` hook (a route, a job, a consumer): asked about an expired claim before anything
runs again. Its answer: the `StoredResponse` to store (an HTTP answer for a request, `stored_result(value)`
for a job or a message), `"run"` (it never happened: run it now), or None (unknown)."""

Verdict: TypeAlias = Literal["completed", "released", "taken", "gone", "changed", "refused", "committed"]
"""`completed`/`released`/`taken`: done; `gone`: no record any more; `changed`: another holder or
state since it was read (the store's answer comes with it when there is one); `refused`: taken over,
but the write after it was refused; `committed`: its effect committed, so it is never released nor
run again."""


async def resolve(
    backend: Backend, key: RecordKey, record: Record, outcome: Outcome, *, lease: float, ttl: float
) -> tuple[Verdict, ClaimResult | None]:
    """Write `outcome` for the expired claim `record` (see the module docstring); an answer of the
    wrong kind or shape for the record's surface raises `WrongAnswer` before anything is written."""
    if isinstance(outcome, StoredResponse):
        check_answer(key, record, outcome)
    if record.effect_committed:
        if not isinstance(outcome, StoredResponse):
            return "committed", None
        current = await backend.get(key)
        if (
            current is None
            or current.state != IN_PROGRESS
            or current.token != record.token
            or current.lease_until != record.lease_until
        ):
            return "changed", None
        return ("completed" if await backend.complete(key, record.token, outcome, ttl=ttl) else "changed"), None
    taken = await backend.takeover(key, record.token, record.fingerprint, lease=lease, ttl=ttl)
    if taken is None:
        return "gone", None
    if not isinstance(taken, Claimed):
        return "changed", taken
    if outcome == "run":
        return "taken", taken
    if outcome == "release":
        return ("released" if await backend.release(key, taken.token) else "refused"), taken
    return ("completed" if await backend.complete(key, taken.token, outcome, ttl=ttl) else "refused"), taken
