"""Resolving one stuck claim by its key: the one operation behind `idem-asgi resolve` and the admin app.

The operator read the claim (`inspect`, `stale`, the admin page) and checked the provider; they
give the token they read and what happened. The write goes through the one recovery algorithm
(`claims.recovery.resolve`), fenced by that token: a claim that is still live (its lease not over
by the store's clock), renewed, completed or taken over since is left alone, and said so. What
was done, and by whom, is a step of the key's history where the store keeps one.
"""

from __future__ import annotations

import contextlib
import re
import time
from dataclasses import dataclass, field

from ..backends import Backend
from ..backends._protocol import Histories
from ..claims.recovery import Outcome, resolve
from ..claims.surfaces import check_answer, surface_of
from ..errors import ConfigurationError, InvalidScope, WrongAnswer
from ..history import Step, lost_claim, token_prefix
from ..http.keys import ANONYMOUS_SCOPE, stored_scope
from ..records import IN_PROGRESS, Record, RecordKey, StoredResponse
from ..transform import AnswerTransform, seal
from .cli_output import iso, label

OLDER_THAN = 60.0
"""Seconds a lease must have been over before `stale`, `reconcile`, `resolve` and the admin app take
it for stuck: a live holder that stalled past its lease (a store stall) renews within that, so none
is mistaken for a dead one. The library's own `reconcile()` gives the same advice: well over the lease."""

SAID = {
    "completed": "stored the answer: retries replay it",
    "released": "released: the next retry runs it",
    "gone": "gone since it was read (released, completed or expired)",
    "changed": "changed since it was read (renewed, completed or taken over): nothing written",
    "refused": "taken over, but the write was refused: inspect it again",
    "committed": "its effect committed (transaction()): it is never released; store its answer instead",
}


_DIGEST_SCOPE = re.compile(r"~h [0-9a-f]{64}")


def record_key(namespace: str, scope: str | None, key: str, *, scope_is: str = "scope") -> RecordKey:
    """The record of `key` as a route keeps it: the scope in its stored form (a stored form, as
    `stale` lists it, is taken as it is); a scope no route could store raises `ConfigurationError`."""
    if not (scope is None or scope == ANONYMOUS_SCOPE or _DIGEST_SCOPE.fullmatch(scope)):
        try:
            scope = stored_scope(scope)
        except InvalidScope as exc:
            raise ConfigurationError(f"invalid {scope_is}: {exc}") from None
    return RecordKey.build(namespace, scope, key)


@dataclass
class Resolution:
    """What came of one resolve: `done` (written), else `why` not; `verdict` as `recovery.resolve` says."""

    done: bool
    verdict: str
    why: str
    record: Record | None = None
    dry_run: bool = False
    would: str = ""
    steps: list[Step] = field(default_factory=list)


def why_not(record: Record, token: int, now: float, older_than: float) -> str | None:
    """Why this record is not the stuck claim the operator means (None: it is)."""
    if record.state != IN_PROGRESS:
        return "it is completed already: there is nothing to resolve (inspect shows its answer)"
    if record.token != token:
        return f"its token is {record.token} now, not {token}: it changed since you read it (inspect it again)"
    if record.lease_until > now:
        return f"its lease runs until {iso(record.lease_until)}: its holder is live; wait for the lease, then retry"
    if record.lease_until > now - older_than:
        return (
            f"its lease ended {now - record.lease_until:.0f} s ago, less than --older-than {older_than:g}: "
            "a live holder stalled past its lease may still renew; wait, or pass --older-than 0"
        )
    return None


async def resolve_key(
    backend: Backend,
    key: RecordKey,
    token: int,
    outcome: Outcome,
    *,
    by: str,
    older_than: float = OLDER_THAN,
    lease: float = 30.0,
    ttl: float | None = None,
    transform: AnswerTransform | None = None,
    dry_run: bool = False,
) -> Resolution:
    """End the stuck claim `token` on `key` with `outcome` (an answer, or `"release"`), as operator `by`."""
    where = label(key.namespace, key.scope, key.key)
    record = await backend.get(key)
    if record is None:
        scope = "" if key.scope else " (a scoped key needs --scope, the scope it was claimed under)"
        return Resolution(False, "missing", f"no record for {where}{scope}: expired, released, or never claimed")
    refused = why_not(record, token, time.time(), older_than)
    if refused is not None:
        return Resolution(False, "refused", refused, record)
    if isinstance(outcome, StoredResponse):
        outcome = seal(transform, outcome)  # marked, so the app opens it with its own transform
        try:
            check_answer(key, record, outcome)
        except WrongAnswer as exc:
            raise ConfigurationError(str(exc)) from None
        doing = f"store a {outcome.status} answer"
    else:
        doing = "release it"
    if dry_run:
        said = f"{surface_of(record.fingerprint)} claim, token {record.token}: would {doing} (dry run)"
        return Resolution(False, "dry_run", said, record, dry_run=True, would=doing)
    lost = None  # the dead holder's `claimed` step, if it died before writing it: kept with the resolution
    if isinstance(backend, Histories):
        with contextlib.suppress(Exception):
            lost = lost_claim(await backend.read_history(key), record)
    verdict, _ = await resolve(backend, key, record, outcome, lease=lease, ttl=ttl or record.ttl or lease)
    done = verdict in ("completed", "released")
    said = SAID.get(verdict, verdict)
    if done and isinstance(outcome, StoredResponse):
        said = f"stored the {outcome.status} answer: retries replay it"
    steps = [
        Step(
            time.time(),
            "resolved" if done else "resolve_refused",
            by=by,
            token=token_prefix(token),
            status=outcome.status if isinstance(outcome, StoredResponse) else None,
            note=verdict,
        )
    ]
    if isinstance(backend, Histories):
        try:
            await backend.write_history([(key, ttl or record.ttl or lease, steps if lost is None else [lost, *steps])])
        except Exception:  # the resolution stands; its note in the history is lost, as in a crash
            steps = []
    return Resolution(done, verdict, said, record, steps=steps)
