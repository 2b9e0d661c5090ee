"""One claim's life, whatever asked for it: claim -> wait -> decide -> run -> settle.

A surface (the ASGI adapter `http.request.Protected`, the job adapter `jobs.decorator.claimed`, and
through it the consumer adapters) builds a `ClaimSession` over one frozen `Runtime` (the store, the
store's one machinery in this process, and the observer: `Runtime.of`, the one place a runtime is
built) and its `Terms` (lease, TTL, wait), then:

1. `claim()` and `at_once(result)`: the usual outcomes (a new claim, a replay) decided at once;
   for the rest `decided(result, recover)`: the pure `decide` table under the lease rule
   (`judged`), holding a repeat while its holder runs (`wait`: woken by the holder in this process,
   by the store's notice, or by a bounded poll) and resolving an expired claim through
   `recovery.resolve`;
2. `begin(token)`: the lease is renewed (`claims.leases.Leases`) while the work runs, and the session
   is the `ClaimHandle` handlers reach (`mark_effect`, `PostgresBackend.transaction()`);
3. `complete(answer)` or `end(keep=...)`: store the answer, release the claim, or keep it as
   outcome-unknown; a write the store fails to take is retried in the background
   (`claims.late_writes.LateWrites`), and held repeats are told (`claims.waiting.Waiters`).

Observers get the same events from every surface, through the runtime's `emit`.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, TypeVar

import anyio

from .._logging import store_failed, throttled
from ..backends._protocol import Watchable
from ..errors import BackendMisconfigured
from ..observe import Event, EventName, Observer
from ..records import Claimed, ClaimResult, Existing, Record, RecordKey, StoredResponse
from .decide import EXPIRED, IN_PROGRESS, REPLAY, RUN, Action, decide
from .recovery import Outcome, resolve
from .runtime import machinery_for
from .terms import Terms

if TYPE_CHECKING:
    from ..backends import Backend
    from .late_writes import LateWrites
    from .leases import Leases
    from .trail import Trail
    from .waiting import Waiters

logger = logging.getLogger("idem_asgi")

_EVENT_OF: dict[Action, EventName] = {
    Action.RUN: "claimed",
    Action.REPLAY: "replayed",
    Action.MISMATCH: "mismatch",
    Action.IN_PROGRESS: "conflict",
    Action.NOT_STORED: "not_stored",
    Action.ANSWER_EXPIRED: "answer_expired",
}

Recover = Callable[[Record], Awaitable['StoredResponse | Literal["run"] | None']]
"""A surface's answer for an expired claim: its answer, `"run"` (it never happened: take it over
and run it here), or None (unknown)."""
Settled = Literal["stored", "lost", "late", "dropped"]
"""A completion: stored; `lost` (the claim was no longer this session's); `late` (the store failed,
retried in the background); `dropped` (the store failed and the retrier is full)."""


R = TypeVar("R", bound="Runtime")


@dataclass(frozen=True, slots=True)
class Runtime:
    """What every session of one surface shares: its store, lease renewer, late-write retrier,
    held repeats and observer (None: nobody is told, and no event is built). Frozen: a surface
    swaps it whole (`use_backend`), and a session keeps the one it started with, so every write
    of one claim goes to one store."""

    store: Backend
    leases: Leases
    late: LateWrites
    waiters: Waiters
    observer: Observer | None
    trail: Trail | None
    watcher: Watchable | None = field(init=False)  # the store, if it can tell when a claim ends
    told: bool = field(init=False)  # somebody hears of each step: an observer, or the key's history

    def __post_init__(self) -> None:
        # What the store can do beyond `Backend`, asked once here, never per request.
        object.__setattr__(self, "watcher", self.store if isinstance(self.store, Watchable) else None)
        object.__setattr__(self, "told", self.observer is not None or self.trail is not None)

    @classmethod
    def of(cls: type[R], store: Backend, observer: Observer | None, *more: Any) -> R:
        """The runtime of a surface over `store`: the store's one machinery in this process (its lease
        renewer, late writes and held repeats, shared by every surface), the observer, and what a
        subclass adds (`more`). The one place a runtime is built."""
        machinery = machinery_for(store)
        return cls(store, machinery.leases, machinery.late, machinery.waiters, observer, machinery.trail, *more)

    def holds(self, digest: str, token: int) -> bool:
        """Whether this process holds claim `token` on record `digest` (see `Machinery.holds`)."""
        return self.leases.held(digest, token) or self.late.holds(digest, token)


class ClaimSession:
    """The state and steps of one claim (see the module docstring); also its `ClaimHandle`."""

    __slots__ = ("_active", "due", "effect", "fingerprint", "rkey", "rt", "terms", "token")

    def __init__(self, rt: Runtime, terms: Terms) -> None:
        self.rt = rt
        self.terms = terms
        self.rkey: RecordKey | None = None
        self.fingerprint = b""
        self.token = 0
        self.effect = False
        self._active = False
        self.due = 0.0  # when the lease renewer next extends it

    # -- the claim handle handlers reach through IdempotencyInfo ----------------------------------

    @property
    def backend(self) -> Backend:
        """The store the claim was made in."""
        return self.rt.store

    @property
    def active(self) -> bool:
        """True while the work runs and its outcome is not final yet."""
        return self._active

    def mark_effect(self) -> None:
        """An irreversible effect happened: from now on a failure keeps the claim (outcome-unknown)."""
        self.effect = True

    def emit(self, name: EventName, status: int | None = None) -> None:
        """Tell the observer about a step (one that raises is logged and ignored), and the key's history."""
        observer = self.rt.observer
        if observer is not None:
            _notify(observer, name, self.terms, self.rkey, status)
        trail = self.rt.trail
        if trail is not None and self.rkey is not None:
            trail.event(self.rkey, name, self.token, status, self.terms.ttl)

    # -- claim, wait, decide ----------------------------------------------------------------------

    def claim(self) -> Awaitable[ClaimResult]:
        """The store's claim of this session's key (its awaitable itself: no frame of our own)."""
        rkey, terms = self.rkey, self.terms
        assert rkey is not None
        return self.rt.store.claim(rkey, self.fingerprint, lease=terms.lease, ttl=terms.ttl)

    async def decided(
        self, result: ClaimResult, recover: Recover | None
    ) -> tuple[Action, ClaimResult | StoredResponse]:
        """What the claim's outcome means, after waiting for a holder (`terms.wait`) and resolving
        an expired claim (`recover`); its event is emitted. With a `StoredResponse` the answer is
        fresh (handed over by the holder, or just recovered). EXPIRED: the outcome is unknown;
        IN_PROGRESS after a recovery: somebody else is resolving it."""
        waited = recovered = False
        while True:
            action = self.judged(result)
            if action is Action.IN_PROGRESS and self.terms.wait and not waited:
                waited = True
                handed = await self.wait(result)
                if isinstance(handed, StoredResponse):  # the holder in this process handed its answer over
                    self.emit("replayed")
                    return (Action.REPLAY if handed.replayable else Action.NOT_STORED), handed
                result = handed
            elif action is Action.EXPIRED and not recovered:
                recovered = True
                self.emit("expired")
                assert isinstance(result, Existing)
                record = result.record
                told = None if recover is None else await recover(record)
                if told is None and record.uncommitted:
                    told = "run"  # its holder died inside a transaction() that never committed: nothing happened
                outcome = await self._recovered(record, told)
                if outcome is None:
                    return Action.EXPIRED, result
                if isinstance(outcome, StoredResponse):
                    return Action.REPLAY, outcome
                result = outcome
            elif action is Action.EXPIRED:  # expired again after a recovery: somebody else is resolving it
                self.emit("conflict")
                return Action.IN_PROGRESS, result
            else:
                if action is not Action.RUN or self.rt.told:
                    self.emit(_EVENT_OF[action])
                return action, result

    def at_once(self, result: ClaimResult) -> Action | None:
        """The two usual outcomes, decided without the loop of `decided`: a new claim (RUN) and a
        completed one to replay (REPLAY). None for the rest (hold, recover, refuse: `decided`)."""
        if result.__class__ is Claimed:
            return RUN
        if decide(result, self.fingerprint) is not REPLAY:
            return None
        keep = self.terms.replay_ttl
        return REPLAY if keep is None or not _past(result, keep) else None

    def judged(self, result: ClaimResult) -> Action:
        """`decide`, under the lease rule (`claims.leases`): an expired lease is in progress while
        this process holds its claim (its work runs, or its answer waits to be written), and until
        it has been seen expired and unchanged for its grace; one its holder ended itself
        (`holder_failed`) is over at once."""
        action = decide(result, self.fingerprint)
        if action is REPLAY:
            keep = self.terms.replay_ttl
            return Action.ANSWER_EXPIRED if keep is not None and _past(result, keep) else action
        if action is not EXPIRED:
            return action
        assert isinstance(result, Existing) and self.rkey is not None
        record, digest = result.record, self.rkey.digest
        if record.holder_failed:  # its holder ended the lease itself: gone
            return action
        if self.rt.holds(digest, record.token):
            return IN_PROGRESS
        over = self.rt.leases.over(digest, record.token, record.lease_until, result.now, self.terms.lease)
        return action if over else IN_PROGRESS

    async def _recovered(self, record: Record, outcome: Outcome | None) -> ClaimResult | StoredResponse | None:
        """Write a recovered `outcome` (None: unknown, left alone); the answer, or the claim to go on with."""
        if outcome is None:
            return None
        rkey, terms = self.rkey, self.terms
        assert rkey is not None
        verdict, taken = await resolve(self.rt.store, rkey, record, outcome, lease=terms.lease, ttl=terms.ttl)
        if verdict == "committed":
            logger.warning("idem_asgi: key %r: its effect committed, so it is not run again", rkey.key)
            return None
        if verdict in ("completed", "taken", "refused"):
            self.emit("recovered")
        if verdict == "gone":  # resolved and gone meanwhile (released, expired): this one is a new claim
            return await self.claim()
        if isinstance(outcome, StoredResponse) and verdict != "changed":
            return outcome
        return await self.claim() if taken is None else taken

    async def wait(self, result: ClaimResult) -> ClaimResult | StoredResponse:
        """Hold a repeat until the first claim ends or `terms.wait` runs out.

        A holder in this process hands its stored answer over (no store call while it runs); one
        elsewhere is told by the store where it can (Redis: three store calls in all), else noticed
        by re-claiming with backoff (10 ms doubling to 250 ms). Returns the answer handed over, or
        the last claim result.
        """
        delay = 0.01
        with anyio.move_on_after(self.terms.wait):
            while isinstance(result, Existing) and self.judged(result) is IN_PROGRESS:
                outcome = await self._held(result, delay)
                if isinstance(outcome, StoredResponse):
                    return outcome
                delay = min(delay * 2, 0.25)
                try:
                    result = await self.claim()
                except Exception as exc:
                    self.store_failed("claim failed while waiting", exc)
                    break
        return result

    async def _held(self, result: Existing, delay: float) -> object:
        """Wait for the claim `result` shows to end, woken once: by its holder when it runs in this
        process (with its stored answer, or when it ends or loses the claim without one); by the
        store's notice when it runs in another, or when the lease seen ends (a holder that died
        tells nobody); else after `delay`, to poll. Returns the holder's stored answer, or not."""
        rkey, waiters, record = self.rkey, self.rt.waiters, result.record
        assert rkey is not None
        future = waiters.watch(rkey.digest, record.token)
        try:
            if self.rt.leases.held(rkey.digest, record.token):
                return await future
            told = await self._watch(record.token)
            # Told: until the lease seen ends. Not told (no notices, or "it changed already", which a
            # store may answer again and again while the claim still reads in progress): the poll delay.
            with anyio.move_on_after(max(record.lease_until - result.now, delay) if told else delay):
                return await future
            return None
        finally:
            waiters.forget(rkey.digest, future)

    async def _watch(self, token: int) -> bool | None:
        """Ask the store to tell this process when the claim ends (None: it cannot, so poll)."""
        watcher, rkey = self.rt.watcher, self.rkey
        if watcher is None or rkey is None:
            return None
        try:
            told: bool | None = await watcher.watch(rkey, token, self.rt.waiters.changed)
        except Exception as exc:
            self.store_failed("watch failed while waiting", exc)
            return None
        return told

    # -- run --------------------------------------------------------------------------------------

    def begin(self, token: int) -> None:
        """The claim is this session's: renew its lease until `stop()`."""
        self.token = token
        self._active = True
        self.rt.leases.hold(self)
        trail = self.rt.trail
        if trail is not None and self.rkey is not None:
            trail.note(self.rkey, "claimed", token, None, self.terms.ttl)

    def stop(self) -> None:
        """The outcome is final or abandoned: stop renewing; later work is not part of the claim."""
        self._active = False
        self.rt.leases.release(self)

    def lost(self) -> None:
        """The claim was lost while the work ran (its lease could not be renewed): held repeats ask again."""
        self.ended(None)

    def ended(self, answer: StoredResponse | None) -> None:
        """Tell repeats held in this process that the claim ended (with its stored answer, or without)."""
        if self.rt.waiters.by_digest:
            rkey = self.rkey
            assert rkey is not None
            self.rt.waiters.ended(rkey.digest, self.token, answer)

    # -- settle -----------------------------------------------------------------------------------

    async def complete(self, answer: StoredResponse, status: int | None = None) -> Settled:
        """Store the answer (as the store keeps it) for every repeat.

        A write the store fails to take is retried in the background: the effect happened, so the
        claim is never released; if the write never lands, the lease expires into outcome-unknown.
        """
        rkey, terms = self.rkey, self.terms
        assert rkey is not None
        try:
            stored = await self.rt.store.complete(rkey, self.token, answer, ttl=terms.ttl)
        except Exception as exc:
            self.ended(None)
            self.emit("store_error", status)
            store_failed(f"could not store the answer for key {rkey.key!r}; retrying in the background", exc)
            late = self.rt.late.complete(self.rt.store, rkey, self.token, answer, terms.ttl, self._emitter(status))
            return "late" if self._retried(late) else "dropped"
        if stored:
            self.ended(answer)
            if self.rt.told:
                self.emit("completed", status)
            return "stored"
        self.ended(None)
        logger.warning("idem_asgi: key %r was no longer held by this request; this answer was not stored", rkey.key)
        self.emit("lease_lost", status)
        return "lost"

    async def end(self, status: int | None, *, keep: bool, release: bool = True) -> None:
        """End without an answer: keep the claim as outcome-unknown (`keep`: the effect may have
        happened), else release it so a retry runs again (unless `release` is False: a cancelled
        request, left to its lease like a crash). Held repeats are told."""
        if keep or release:
            await self._ending(status, keep=keep)
        self.ended(None)

    async def _ending(self, status: int | None, *, keep: bool) -> None:
        """Delete the claim (fenced by its token) so a retry runs again, or (`keep`) end its lease:
        outcome-unknown until recovery resolves it. A write the store fails is retried later."""
        rkey, rt = self.rkey, self.rt
        assert rkey is not None
        store, late = rt.store, rt.late
        write, retry, doing = (
            (store.mark_failed, late.mark_failed, "end the lease of")
            if keep
            else (store.release, late.release, "release")
        )
        try:
            done = await write(rkey, self.token)
        except Exception as exc:
            self.emit("store_error", status)
            store_failed(f"could not {doing} key {rkey.key!r}; retrying in the background", exc)
            self._retried(retry(store, rkey, self.token, self._emitter(status)))
            return
        if done and keep:
            logger.warning(
                "idem_asgi: key %r failed after its answer started or its effect; kept as outcome-unknown", rkey.key
            )
        elif not done and not keep:
            logger.warning("idem_asgi: key %r was no longer held by this request; it was not released", rkey.key)
        self.emit(("unresolved" if keep else "released") if done else "lease_lost", status)

    def _emitter(self, status: int | None) -> Callable[[EventName], None]:
        """`emit` for a write made later (idem_asgi.claims.late_writes), with this claim's key and status."""
        observer, trail, terms, rkey, token = self.rt.observer, self.rt.trail, self.terms, self.rkey, self.token
        if trail is None or rkey is None:
            if observer is None:
                return _ignored
            return lambda name: _notify(observer, name, terms, rkey, status)

        def emit(name: EventName) -> None:
            if observer is not None:
                _notify(observer, name, terms, rkey, status)
            trail.event(rkey, name, token, status, terms.ttl)

        return emit

    def _retried(self, started: bool) -> bool:
        """Log a write the retrier refused (its memory bound is reached): the key is left to its lease."""
        if not started:
            assert self.rkey is not None
            logger.error("idem_asgi: too many writes waiting for the store; key %r is not retried", self.rkey.key)
        return started

    def store_failed(self, what: str, exc: Exception) -> None:
        """A store call failed: tell the observer, and log it (a misconfigured store at most once a minute)."""
        self.emit("store_error")
        if isinstance(exc, BackendMisconfigured):
            throttled(logging.ERROR, f"idem_asgi: the idempotency store refuses this app: {exc}")
        else:
            store_failed(what, exc)


def _notify(observer: Observer, name: EventName, terms: Terms, rkey: RecordKey | None, status: int | None) -> None:
    try:
        key, owner = (None, None) if rkey is None else (rkey.key, rkey.scope or None)
        observer(Event(name, terms.label, key, owner, status))
    except Exception:  # observability never fails a request or a job
        logger.exception("idem_asgi: observer failed on %r", name)


def _ignored(name: EventName) -> None:
    """Nobody observes."""


def _past(result: ClaimResult, keep: float) -> bool:
    """Whether a completed record's answer is past its `replay_ttl` (`keep`), by the store's clock: a
    completed record's `lease_until` is when it completed."""
    assert isinstance(result, Existing)
    return result.now >= result.record.lease_until + keep
