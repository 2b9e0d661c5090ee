"""Resolve stuck claims from outside the request path: the reconcile runner behind `idem-asgi reconcile`.

A claim whose holder died between claim and completion stays in progress: retries get
`outcome-unknown` until somebody finds out what happened. `reconcile()` lists such claims
(`stale()`, by the store's clock) and asks `resolve` about each, with the same contract as the
middleware's `recover` hook, only without a request waiting:

- a `StoredResponse`: the operation happened (the provider has it under the same key); store
  this answer, and every retry replays it from now on;
- `"release"`: the operation never happened (the provider does not know the key); delete the
  claim, so the client's next retry runs it;
- `None`: still unknown; leave the claim alone (retries keep getting `outcome-unknown`).

Every write is fenced by the token the listing read, and goes through `takeover`, which the
store grants only while that token still holds and its lease is still over (store clock). A
claim completed, released, renewed or taken over by anyone between the listing and the write
is left alone and counted as skipped. So it is safe to run from cron while serving, and twice
at once.

A dry run (`dry_run=True`, `idem-asgi reconcile --dry-run`) writes nothing to the store, and tells
the resolver so: `is_dry_run()` is True while it runs, so a resolver that writes anything of its
own (a ledger entry, a refund) can skip it.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Literal, Protocol, TypeAlias

import anyio
import msgspec

from .._logging import redact
from ..backends import Backend, Histories, Maintenance
from ..claims.recovery import Verdict, resolve
from ..errors import ConfigurationError, WrongAnswer
from ..history import Step, this_process, token_prefix
from ..records import Record, RecordKey, StaleRecord, StoredResponse
from ..transform import AnswerTransform, seal

__all__ = [
    "ReconcilableBackend",
    "ReconcileItem",
    "ReconcileReport",
    "Resolution",
    "Resolver",
    "is_dry_run",
    "key_among",
    "reconcile",
    "resolver_from_recover",
]

logger = logging.getLogger("idem_asgi.ops.reconcile")
_DRY_RUN: ContextVar[bool] = ContextVar("idem_asgi_reconcile_dry_run", default=False)


def is_dry_run() -> bool:
    """True while a resolver runs for a dry run (`reconcile(dry_run=True)`, `--dry-run`): the
    store is not written, and a resolver with writes of its own should skip them too."""
    return _DRY_RUN.get()


Resolution: TypeAlias = StoredResponse | Literal["release"] | None
"""What a resolver answers: the stored answer, `"release"` (never happened), or None (unknown)."""

Resolver: TypeAlias = Callable[[StaleRecord], Awaitable[Resolution] | Resolution]
"""`resolve(stale_record)`, sync or async."""

Action = Literal["completed", "released", "unresolved", "skipped", "error"]


class ReconcilableBackend(Backend, Maintenance, Protocol):
    """A store with the ops half (`stale`, `purge`): every built-in backend."""


class ReconcileItem(msgspec.Struct, frozen=True):
    """What happened to one stale claim (or, in a dry run, what would have)."""

    namespace: str
    scope: str
    key: str
    token: int
    lease_until: float
    action: Action
    detail: str = ""
    digest: str = ""
    """The record's key digest (a store that keeps no raw keys lists scope and key as "?")."""


class ReconcileReport(msgspec.Struct):
    """Counts for one run; `completed + released + unresolved + skipped + errors == examined`."""

    examined: int = 0
    completed: int = 0
    released: int = 0
    unresolved: int = 0
    skipped: int = 0
    errors: int = 0
    dry_run: bool = False
    items: list[ReconcileItem] = msgspec.field(default_factory=list)

    def count(self, item: ReconcileItem) -> None:
        self.items.append(item)
        if item.action == "completed":
            self.completed += 1
        elif item.action == "released":
            self.released += 1
        elif item.action == "unresolved":
            self.unresolved += 1
        elif item.action == "skipped":
            self.skipped += 1
        else:
            self.errors += 1


def key_among(stale: StaleRecord, candidates: Iterable[tuple[str | None, str]]) -> tuple[str, str] | None:
    """The (scope, client key) of `stale` among `candidates`, or None when it is not one of them.

    Stores keep only a digest of each key (unless `store_keys=True`), so a listed claim's scope and
    key read "?": a resolver that can list what its provider saw lately (its recent idempotency
    keys, rebuilt as (scope, client key)) finds the claim's own by digest, then asks the provider
    by it. A claim whose store kept the raw key is returned as it is.
    """
    k = stale.key
    if not k.hidden:
        return k.scope, k.key
    for scope, key in candidates:
        if RecordKey.build(k.namespace, scope, key).digest == k.digest:
            return scope or "", key
    return None


def resolver_from_recover(
    hook: Callable[[RecordKey, Record], Awaitable[StoredResponse | Literal["run"] | None]],
) -> Callable[[StaleRecord], Awaitable[Resolution]]:
    """Use a middleware `recover` hook as the resolver: its `"run"` (never happened) becomes `"release"`."""

    async def resolve(stale: StaleRecord) -> Resolution:
        outcome = await hook(stale.key, stale.record)
        return "release" if outcome == "run" else outcome

    return resolve


async def reconcile(
    backend: ReconcilableBackend,
    resolve: Resolver,
    *,
    older_than: float,
    limit: int = 1000,
    ttl: float | None = None,
    lease: float = 30,
    namespace: str | None = None,
    dry_run: bool = False,
    concurrency: int = 1,
    transform: AnswerTransform | None = None,
) -> ReconcileReport:
    """Resolve up to `limit` claims whose lease ended more than `older_than` seconds ago.

    Args:
        backend: The store (it needs `stale()`: every built-in backend has it).
        resolve: Called once per stale claim, sync or async; see the module docstring.
            One that raises is logged and counted in `errors`, and the run goes on.
        older_than: Seconds since the lease ended. Give a live holder time to renew: well over
            the route's lease (its holder renews every third of it).
        limit: Claims examined in this run (run again for more; unresolved ones are listed again).
        ttl: How long a resolved answer is kept for replay, from now. Default: the TTL the record was
            claimed with (its route's). A record written by a version that did not store it is
            skipped unless `ttl` is given: never a silent default.
        lease: The short lease held between taking a claim over and writing its outcome.
        namespace: Only this namespace's claims (another app's claims need another resolver).
        dry_run: Ask `resolve` but write nothing; the counts say what would have been done, and
            `is_dry_run()` tells `resolve` (so it skips writes of its own).
        concurrency: Claims resolved at once (each `resolve` may call a payment provider).
        transform: The middleware's `transform`, if it has one: resolved answers are sealed through
            it (and marked so). Without one they are stored in clear, marked so, and replay as
            stored whatever transform the app has (`idem_asgi.transform`).
    """
    if concurrency < 1:
        raise ConfigurationError(f"concurrency must be at least 1, got {concurrency!r}")
    if not isinstance(backend, Maintenance):
        raise ConfigurationError(f"{type(backend).__name__} has no stale(): it cannot list stuck claims")
    stale = await backend.stale(older_than, limit, namespace=namespace)
    report = ReconcileReport(examined=len(stale), dry_run=dry_run)
    slots = anyio.Semaphore(concurrency)
    run = _Run(backend, resolve, ttl, lease, dry_run, transform)

    async def one(s: StaleRecord) -> None:
        async with slots:
            action, detail = await _resolve_one(run, s)
        _count(report, s, action, detail)

    told = _DRY_RUN.set(dry_run)  # the resolvers' tasks inherit it: `is_dry_run()`
    try:
        async with anyio.create_task_group() as tg:
            for s in stale:
                tg.start_soon(one, s)
    finally:
        _DRY_RUN.reset(told)
    # Items are appended as they finish: put them back in listing order (oldest lease first).
    report.items.sort(key=lambda item: item.lease_until)
    if not dry_run and isinstance(backend, Histories):
        await _note_resolved(backend, stale, report)
    return report


async def _note_resolved(backend: Histories, stale: list[StaleRecord], report: ReconcileReport) -> None:
    """A `resolved` step in each resolved key's history, by this run (one write for the run; a
    store that fails it loses the steps, never the resolutions)."""
    listed = {(s.key.digest, s.record.token): s for s in stale}
    by = f"reconcile on {this_process()}"
    batch = []
    for item in report.items:
        s = listed.get((item.digest, item.token))
        if s is not None and item.action in ("completed", "released"):
            step = Step(time.time(), "resolved", by=by, token=token_prefix(item.token), note=item.detail)
            batch.append((s.key, s.record.ttl or 60.0, [step]))
    if batch:
        try:
            await backend.write_history(batch)
        except Exception as exc:
            logger.warning("idem_asgi: reconcile could not write the keys' history: %s", exc)


def _count(report: ReconcileReport, s: StaleRecord, action: Action, detail: str) -> None:
    k = s.key
    report.count(
        ReconcileItem(k.namespace, k.scope, k.key, s.record.token, s.record.lease_until, action, detail, k.digest)
    )
    log = logger.warning if action == "error" else logger.info
    log("idem_asgi: reconcile %s key=%r scope=%r: %s %s", k.namespace, k.key, k.scope, action, detail)


@dataclass(frozen=True, slots=True)
class _Run:
    """What every claim of one `reconcile` run is resolved with."""

    backend: ReconcilableBackend
    resolve: Resolver
    ttl: float | None
    lease: float
    dry_run: bool
    transform: AnswerTransform | None


async def _resolve_one(run: _Run, s: StaleRecord) -> tuple[Action, str]:
    backend, ttl, lease, dry_run = run.backend, run.ttl, run.lease, run.dry_run
    try:
        outcome = run.resolve(s)
        if inspect.isawaitable(outcome):
            outcome = await outcome
    except Exception as exc:
        # The resolver talks to a payment provider: its exception text may carry a key or token.
        detail = f"resolve raised {type(exc).__name__}: {redact(str(exc))}"
        logger.warning("idem_asgi: reconcile resolver failed for key %r: %s", s.key.key, detail)
        logger.debug("idem_asgi: reconcile resolver traceback", exc_info=exc)
        return "error", detail
    if outcome is None:
        return "unresolved", "outcome still unknown"
    if outcome == "release":
        if s.effect_committed:
            # The store recorded that the effect committed (Postgres transaction()): running it again
            # would do it twice, whatever the resolver believes. The store would refuse anyway.
            return "skipped", "its effect committed (transaction()); never released"
        if dry_run:
            return "released", "dry run: would release"
    elif isinstance(outcome, StoredResponse):
        if dry_run:
            return "completed", f"dry run: would store a {outcome.status} answer"
    else:
        return "error", f"resolve returned {outcome!r}; expected a StoredResponse, 'release' or None"
    keep = s.record.ttl if ttl is None else ttl
    if keep is None and isinstance(outcome, StoredResponse):
        return "skipped", "its TTL is not stored (an older record): pass ttl= (--ttl) to store an answer"
    try:
        if isinstance(outcome, StoredResponse):
            outcome = seal(run.transform, outcome)  # marked, so the app opens it with its own transform
        return await _apply(backend, s, outcome, ttl=keep or lease, lease=lease)
    except WrongAnswer as exc:  # an HTTP answer for a job's record, a result its job cannot return
        logger.warning("idem_asgi: reconcile refused the resolver's answer for key %r: %s", s.key.key, exc)
        return "error", f"answer refused: {exc}"
    except Exception as exc:
        logger.warning("idem_asgi: reconcile could not write the outcome for key %r: %s", s.key.key, exc)
        return "error", f"store failed: {type(exc).__name__}: {redact(str(exc))}"


_SAID: dict[Verdict, tuple[Action, str]] = {
    "released": ("released", "released; the next retry runs it"),
    "gone": ("skipped", "gone since it was listed (released, completed or expired)"),
    "changed": ("skipped", "changed since it was listed"),
    "committed": ("skipped", "its effect committed (transaction()); never released"),
}


async def _apply(
    backend: ReconcilableBackend,
    s: StaleRecord,
    outcome: StoredResponse | Literal["release"],
    *,
    ttl: float,
    lease: float,
) -> tuple[Action, str]:
    """Write the outcome through the one recovery algorithm (`claims.recovery`), fenced by the
    listed token: a claim completed, released, renewed or taken over since is left alone."""
    verdict, _ = await resolve(backend, s.key, s.record, outcome, lease=lease, ttl=ttl)
    if verdict == "completed":
        assert isinstance(outcome, StoredResponse)
        return "completed", f"stored a {outcome.status} answer"
    if verdict == "refused":
        what = "the release" if outcome == "release" else "storing the answer"
        return "error", f"taken over, but {what} was refused; it will be listed again"
    return _SAID[verdict]
