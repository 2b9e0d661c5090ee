"""One protected request, from its key to its answer. The steps read top to bottom:

read the key, find the scope -> read the body -> derive the key -> claim -> decide ->
run (capturing the answer) / replay / refuse.

The middleware keeps only configuration; everything about one request lives on one `Protected`
object, which is also the `ClaimHandle` handlers reach through `IdempotencyInfo` (to mark an
effect, or for `PostgresBackend.transaction()` to find the claim).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Container
from email.utils import formatdate
from typing import TYPE_CHECKING, Final, Literal

import anyio

from . import problems
from ._admission import Refused, parsed_key, request_scope, sentence
from ._asgi import (
    HIDDEN_EXTENSIONS,
    TooLarge,
    length_over,
    read_body,
    replaying,
    run_unclaimed,
)
from ._capture import Capture
from ._decide import Action, decide
from ._logging import redact, store_failed, throttled
from ._types import Message, Receive, Scope, Send
from .context import STATE_KEY, IdempotencyInfo, enter, leave
from .errors import BackendMisconfigured, StoreFull
from .fingerprint import digest
from .keys import route_key
from .observe import EventName
from .records import Claimed, ClaimResult, Existing, Record, RecordKey, StoredResponse
from .routing import Route, route_path
from .transform import seal, unseal

if TYPE_CHECKING:
    from .backends import Backend
    from .middleware import IdempotencyMiddleware

logger = logging.getLogger("idem_asgi")

_EVENT_OF: dict[Action, EventName] = {
    Action.RUN: "claimed",
    Action.REPLAY: "replayed",
    Action.MISMATCH: "mismatch",
    Action.IN_PROGRESS: "conflict",
    Action.NOT_STORED: "not_stored",
    Action.EXPIRED: "expired",
}


class Protected:
    """The state and steps of one request on a protected route."""

    __slots__ = (
        "_active",
        "body",
        "due",
        "effect",
        "fingerprint",
        "key",
        "mw",
        "owner",
        "receive",
        "rkey",
        "route",
        "scope",
        "send",
        "token",
    )

    def __init__(self, mw: IdempotencyMiddleware, route: Route, scope: Scope, receive: Receive, send: Send) -> None:
        self.mw = mw
        self.route = route
        self.scope = scope
        self.receive = receive
        self.send = send
        self.key = ""
        self.owner: str | None = None
        self.body = b""
        self.fingerprint = b""
        self.rkey: RecordKey | None = None
        self.token = 0
        self.effect = False
        self._active = False
        self.due = 0.0

    # -- the claim handle handlers reach through IdempotencyInfo ----------------------------------

    @property
    def backend(self) -> Backend:
        """The store the claim was made in."""
        return self.mw.backend

    @property
    def active(self) -> bool:
        """True while the app runs and its answer is not final yet."""
        return self._active

    def mark_effect(self) -> None:
        """An irreversible effect happened: from now on a failure keeps the claim (outcome-unknown)."""
        self.effect = True

    # -- the steps --------------------------------------------------------------------------------

    async def handle(self) -> None:
        """Answer the request: pass it through, refuse it, replay the stored answer, or run the app once."""
        try:
            if not await self._prepare():
                return
            route, rkey = self.route, self.rkey
            assert rkey is not None
            try:
                result = await self.mw.backend.claim(rkey, self.fingerprint, lease=route.lease, ttl=route.ttl)
            except Exception as exc:
                await self._claim_failed(exc)  # refuses, or (fail-open) runs the app unclaimed
                return
            if result.__class__ is Claimed:  # a new key: the usual case, decided without `decide`
                if self.mw.observed:
                    self.mw.emit("claimed", route, rkey)
                await self._run(result.token)
            else:
                await self._act(result)
        except Refused as refusal:
            if refusal.event is not None:
                self.mw.emit(refusal.event, self.route, self.rkey, refusal.problem.status)
            await problems.send_problem(
                self.send,
                refusal.problem,
                refusal.detail,
                retry_after=refusal.retry_after,
                base=problems.located(self.mw.problem_base, self.scope),
            )

    async def _prepare(self) -> bool:
        """Read the key, the scope and the body. False when the request was passed through or ended."""
        route, scope = self.route, self.scope
        raw: bytes | None = None
        count = 0
        length: bytes | None = None
        name = route.header
        for k, v in scope["headers"]:  # one pass: the key header, and the declared length
            if k == name:
                raw = v
                count += 1
            elif k == b"content-length":
                length = v
        given = parsed_key(route, raw, count) if count else None
        if given is None and route.key_source is None:
            if route.required:
                raise Refused(problems.KEY_REQUIRED, f"This operation requires an {route.header_name} header.")
            await self.mw.app(scope, self.receive, self.send)
            return False
        # The scope needs no body: a request that names nobody is refused before any body work.
        stored_owner, self.owner = request_scope(route, scope)
        limit = route.max_body
        if length is not None and length_over(length, limit):
            raise self._too_large()
        hasher = route.fingerprint.begin(scope)
        message = await self.receive()
        if message["type"] == "http.request" and not message.get("more_body", False):
            body = message.get("body", b"")  # the whole body in one message: the usual case
            if len(body) > limit:
                raise self._too_large()
            hasher.update(body)
        else:
            try:
                body = await read_body(self.receive, limit, hasher.update, first=message)
            except TooLarge:
                raise self._too_large() from None
            if body is None:
                return False  # the client left before anything was claimed
        self.body = body
        self.fingerprint = await digest(hasher, len(body))
        if route.key_source is None:
            assert given is not None
            self.key = stored = given
        else:
            derived = route.key_source(scope, body, given)
            if derived is None:
                if route.required:
                    raise Refused(
                        problems.KEY_REQUIRED, "This operation needs the fields its idempotency key is made of."
                    )
                await self.mw.app(scope, replaying(body, self.receive), self.send)
                return False
            # A derived key lives in its route's own key space: never a header key's, nor another route's.
            self.key = derived
            stored = route_key(scope["method"], route_path(scope), derived)
        self.rkey = RecordKey.build(self.mw.namespace, stored_owner, stored)
        return True

    async def _claim_failed(self, exc: Exception) -> None:
        """The claim raised: refuse (503, 429, 500 raise `Refused`), or with fail-open run the app unclaimed."""
        route, rkey = self.route, self.rkey
        if isinstance(exc, StoreFull):
            self.mw.emit("store_error", route, rkey)
            problem = problems.KEY_QUOTA if exc.scope_quota else problems.STORE_UNAVAILABLE
            raise Refused(problem, sentence(str(exc)), retry_after=route.retry_after, event=None) from None
        self._store_failed("claim failed", exc)
        if self.mw.fail_open:
            receive = replaying(self.body, self.receive)
            await run_unclaimed(self.mw.app, self.scope, receive, self.send, self.key, self.owner)
            return
        raise self._store_refusal(exc) from None

    async def _act(self, result: ClaimResult) -> None:
        """Decide what the claim's outcome means, then run, replay or refuse."""
        route = self.route
        waited = recovered = False
        while True:
            action = decide(result, self.fingerprint)
            if action is Action.IN_PROGRESS and route.wait and not waited:
                waited = True
                handed = await self._wait(result)
                if isinstance(handed, StoredResponse):  # the holder in this process handed its answer over
                    self.mw.emit("replayed", route, self.rkey)
                    if not handed.replayable:
                        raise Refused(problems.NOT_STORED, event=None)
                    await self._replay(handed, time.time() + route.ttl)  # completed just now
                    return
                result = handed
            elif action is Action.EXPIRED and not recovered:
                recovered = True
                self.mw.emit("expired", route, self.rkey)
                assert isinstance(result, Existing)
                outcome = await self._recover(result.record)
                if isinstance(outcome, StoredResponse):
                    await self._replay(outcome, time.time() + route.ttl)
                    return
                result = outcome
            else:
                break
        if action is Action.EXPIRED:
            raise Refused(problems.IN_PROGRESS, "The request is being recovered.", retry_after=route.retry_after)
        self.mw.emit(_EVENT_OF[action], route, self.rkey)
        if action is Action.RUN:
            assert isinstance(result, Claimed)
            await self._run(result.token)
        elif action is Action.REPLAY:
            assert isinstance(result, Existing) and result.record.response is not None
            await self._replay(self._opened(result.record.response), result.record.expires_at)
        elif action is Action.MISMATCH:
            raise Refused(problems.FINGERPRINT_MISMATCH, event=None)
        elif action is Action.IN_PROGRESS:
            raise Refused(problems.IN_PROGRESS, retry_after=route.retry_after, event=None)
        else:
            raise Refused(problems.NOT_STORED, event=None)

    async def _wait(self, result: ClaimResult) -> ClaimResult | StoredResponse:
        """Hold a repeat until the first request ends or the route's `wait` runs out.

        A holder in this process hands its stored answer over (no store call while it runs); one
        elsewhere is told by the store where it can (Redis: three store calls in all), else noticed
        by re-claiming with backoff (10 ms doubling to 250 ms). Returns the answer handed over, or
        the last claim result.
        """
        route, rkey = self.route, self.rkey
        assert rkey is not None
        delay = 0.01
        with anyio.move_on_after(route.wait):
            while isinstance(result, Existing) and decide(result, self.fingerprint) is Action.IN_PROGRESS:
                outcome = await self._held(result, delay)
                if isinstance(outcome, StoredResponse):
                    return outcome
                delay = min(delay * 2, 0.25)
                try:
                    result = await self.mw.backend.claim(rkey, self.fingerprint, lease=route.lease, ttl=route.ttl)
                except Exception as exc:
                    self._store_failed("claim failed while waiting", exc)
                    break
        return result

    async def _held(self, result: Existing, delay: float) -> object:
        """Wait for the claim `result` shows to end, woken once: by its holder when it runs in this
        process (with its stored answer, or when it ends or loses the claim without one); by the
        store's notice when it runs in another, or when the lease seen ends (a holder that died
        tells nobody); else after `delay`, to poll. Returns the holder's stored answer, or not."""
        rkey, waiters, record = self.rkey, self.mw.waiters, result.record
        assert rkey is not None
        future = waiters.watch(rkey.digest, record.token)
        try:
            if self.mw.leases.held(rkey.digest, record.token):
                return await future
            told = await self._watch(record.token)
            if told is False:
                return None  # it changed already: read it again
            with anyio.move_on_after(max(record.lease_until - result.now, delay) if told else delay):
                return await future
            return None
        finally:
            waiters.forget(rkey.digest, future)

    async def _watch(self, token: int) -> bool | None:
        """Ask the store to tell this process when the claim ends (None: it cannot, so poll)."""
        watcher, rkey = self.mw.watcher, self.rkey  # the store's ability, asked once at construction
        if watcher is None or rkey is None:
            return None
        try:
            told: bool | None = await watcher.watch(rkey, token, self.mw.waiters.changed)
        except Exception as exc:
            self._store_failed("watch failed while waiting", exc)
            return None
        return told

    def lost(self) -> None:
        """The claim was lost while the app ran (its lease could not be renewed): held repeats ask again."""
        self._ended(None)

    def _ended(self, answer: StoredResponse | None) -> None:
        """Tell repeats held in this process that the claim ended (with its stored answer, or without)."""
        if self.mw.waiters:
            rkey = self.rkey
            assert rkey is not None
            self.mw.waiters.ended(rkey.digest, self.token, answer)

    async def _recover(self, record: Record) -> ClaimResult | StoredResponse:
        """An expired lease: ask the recover hook (or reclaim), then take the claim over or store its answer."""
        route, rkey, backend = self.route, self.rkey, self.mw.backend
        assert rkey is not None
        outcome: StoredResponse | Literal["run"] | None = None
        if route.recover is not None:
            try:
                outcome = await route.recover(rkey, record)
            except Exception as exc:  # its text may carry a provider's key or token
                logger.warning(
                    "idem_asgi: recover hook failed for key %r: %s: %s", rkey.key, type(exc).__name__, redact(str(exc))
                )
                logger.debug("idem_asgi: recover hook traceback", exc_info=exc)
        elif route.on_expired == "reclaim" and not (record.holder_failed or record.effect_committed):
            outcome = "run"  # the holder vanished (crash, stall); a holder that failed mid-answer is never re-run
        if outcome == "run" and record.effect_committed:
            logger.warning("idem_asgi: key %r: its effect committed, so it is not run again", rkey.key)
            outcome = None
        if outcome is None:
            raise Refused(problems.OUTCOME_UNKNOWN, event="outcome_unknown")
        try:
            if record.effect_committed:
                # Never taken over (that could run the effect again): the answer goes under the holder's token.
                assert isinstance(outcome, StoredResponse)
                if not await backend.complete(rkey, record.token, self._sealed(outcome), ttl=route.ttl):
                    raise Refused(
                        problems.IN_PROGRESS, "The request is being recovered.", retry_after=route.retry_after
                    )
                self.mw.emit("recovered", route, rkey)
                return outcome
            taken = await backend.takeover(rkey, record.token, self.fingerprint, lease=route.lease, ttl=route.ttl)
            if taken is None:  # resolved and gone meanwhile (released, expired): this request is a new one
                return await backend.claim(rkey, self.fingerprint, lease=route.lease, ttl=route.ttl)
            if isinstance(taken, Claimed):
                self.mw.emit("recovered", route, rkey)
                if isinstance(outcome, StoredResponse):
                    await backend.complete(rkey, taken.token, self._sealed(outcome), ttl=route.ttl)
                    return outcome
            return taken
        except Refused:
            raise
        except Exception as exc:
            self._store_failed("takeover failed", exc)
            raise self._store_refusal(exc) from None

    async def _run(self, token: int) -> None:
        """Run the app once under the claim, streaming its answer while capturing it."""
        mw, route, rkey = self.mw, self.route, self.rkey
        assert rkey is not None
        self.token = token
        self._active = True
        mw.leases.hold(self)
        send = self.send if not route.advertise_expiry else _expiring(self.send, route.ttl, route.release_statuses)
        capture = Capture(
            send, self.receive, self.body, self._on_final, excluded=route.excluded, limit=route.max_stored_body
        )
        info = IdempotencyInfo(self.key, self.owner, self)
        entered = enter(info)
        try:
            await mw.app(self._app_scope(info), capture.receive, capture)
        except Exception:
            if not capture.finished:
                with anyio.CancelScope(shield=True):
                    await self._unfinished(capture, cancelled=False)
            raise
        except BaseException:
            if not capture.finished:
                with anyio.CancelScope(shield=True):
                    await self._unfinished(capture, cancelled=True)
            raise
        finally:
            leave(entered)
            info._claim = None  # no cycle request <-> info: freed by refcount, not by the GC
            if self._active:
                self._stop()
            capture.wake()
        if not capture.finished:
            await self._unfinished(capture, cancelled=False)

    def _app_scope(self, info: IdempotencyInfo) -> Scope:
        """The scope the app sees: the same `state` dict (shared with outer middleware), extensions hidden."""
        scope = self.scope
        state = scope.get("state")
        if state is None:
            state = scope["state"] = {}
        state[STATE_KEY] = info
        extensions = scope.get("extensions")
        if extensions and any(e in extensions for e in HIDDEN_EXTENSIONS):
            # Hiding pathsend/zerocopysend makes every body byte pass through `send`, so it is stored.
            scope = {**scope, "extensions": {k: v for k, v in extensions.items() if k not in HIDDEN_EXTENSIONS}}
        return scope

    def _stop(self) -> None:
        """The answer is final or abandoned: stop renewing, and later work is not part of the claim."""
        self._active = False
        self.mw.leases.release(self)

    async def _on_final(self, response: StoredResponse) -> None:
        """The app sent its whole answer: store it (or release the claim), before its last chunk goes out."""
        self._stop()
        route, rkey = self.route, self.rkey
        assert rkey is not None
        if response.status in route.release_statuses:
            if self.effect:
                await self._fail(response.status)
            else:
                await self._release(response.status)
            self._ended(None)
            return
        try:
            sealed = self._sealed(response)
        except Exception as exc:  # the client still gets its answer; the claim stays, as after a failed write
            self._ended(None)
            self.mw.emit("store_error", route, rkey, response.status)
            throttled(logging.ERROR, f"idem_asgi: the answer transform failed; key {rkey.key!r} not stored: {exc!r}")
            return
        try:
            stored = await self.mw.backend.complete(rkey, self.token, sealed, ttl=route.ttl)
        except Exception as exc:
            self._ended(None)
            self.mw.emit("store_error", route, rkey, response.status)
            # The effect happened and the client gets its answer. Never release: retry the write
            # in the background; if it never lands, the lease expires into outcome-unknown.
            store_failed(f"could not store the answer for key {rkey.key!r}; retrying in the background", exc)
            self._retried(self.mw.late.complete(rkey, self.token, sealed, route.ttl, self._emitter(response.status)))
            return
        if stored:
            self._ended(response)
            if self.mw.observed:
                self.mw.emit("completed", route, rkey, response.status)
        else:
            self._ended(None)
            logger.warning("idem_asgi: key %r was no longer held by this request; this answer was not stored", rkey.key)
            self.mw.emit("lease_lost", route, rkey, response.status)

    async def _unfinished(self, capture: Capture, *, cancelled: bool) -> None:
        """The app raised, was cancelled, or returned without finishing its answer."""
        self._stop()
        status = capture.status if capture.started else None
        if self.effect or (capture.started and capture.status not in self.route.release_statuses):
            # The answer had started (or an effect was marked): the operation may have happened,
            # so a retry must never run it again. The record ends outcome-unknown at once.
            await self._fail(status)
        elif not cancelled:
            await self._release(status)
        # Cancelled before anything was answered: like a crash, the claim is kept and its lease ends.
        self._ended(None)

    async def _release(self, status: int | None) -> None:
        """Delete the claim (fenced by its token) so a retry runs again."""
        route, rkey = self.route, self.rkey
        assert rkey is not None
        try:
            released = await self.mw.backend.release(rkey, self.token)
        except Exception as exc:
            self.mw.emit("store_error", route, rkey, status)
            store_failed(f"could not release key {rkey.key!r}; retrying in the background", exc)
            self._retried(self.mw.late.release(rkey, self.token, self._emitter(status)))
            return
        if released:
            self.mw.emit("released", route, rkey, status)
        else:
            logger.warning("idem_asgi: key %r was no longer held by this request; it was not released", rkey.key)
            self.mw.emit("lease_lost", route, rkey, status)

    async def _fail(self, status: int | None) -> None:
        """Keep the claim with its lease ended: outcome-unknown until recovery resolves it."""
        route, rkey = self.route, self.rkey
        assert rkey is not None
        try:
            kept = await self.mw.backend.mark_failed(rkey, self.token)
        except Exception as exc:
            self.mw.emit("store_error", route, rkey, status)
            store_failed(f"could not end the lease of key {rkey.key!r}; retrying in the background", exc)
            self._retried(self.mw.late.mark_failed(rkey, self.token, self._emitter(status)))
            return
        if kept:
            logger.warning(
                "idem_asgi: key %r failed after its answer started or its effect; kept as outcome-unknown", rkey.key
            )
            self.mw.emit("unresolved", route, rkey, status)
        else:
            self.mw.emit("lease_lost", route, rkey, status)

    def _emitter(self, status: int | None) -> Callable[[EventName], None]:
        """`emit` for a write made later (idem_asgi._late_writes), with this request's route, key and status."""
        mw, route, rkey = self.mw, self.route, self.rkey
        return lambda name: mw.emit(name, route, rkey, status)

    def _retried(self, started: bool) -> None:
        """Log a write the retrier refused (its memory bound is reached): the key is left to its lease."""
        if not started:
            assert self.rkey is not None
            logger.error("idem_asgi: too many writes waiting for the store; key %r is not retried", self.rkey.key)

    def _sealed(self, response: StoredResponse) -> StoredResponse:
        """The answer as the store keeps it (the middleware's `transform`, marked sealed)."""
        return seal(self.mw.transform, response)

    def _opened(self, response: StoredResponse) -> StoredResponse:
        """A stored answer as it is replayed; a sealed one this server cannot open is a misconfiguration."""
        if not response.sealed:
            return response  # stored in clear (also before the transform was turned on): as it was stored
        try:
            return unseal(self.mw.transform, response)
        except Exception as exc:
            throttled(logging.ERROR, f"idem_asgi: the answer transform cannot read a stored answer: {exc!r}")
            raise Refused(
                problems.STORE_MISCONFIGURED, "A stored answer cannot be read with this server's transform."
            ) from None

    async def _replay(self, response: StoredResponse, expires_at: float) -> None:
        """Send the stored answer verbatim, marked as a replay (and, if asked, when it expires)."""
        headers = list(response.headers)
        headers.append(self.mw.replay_header)
        if self.route.advertise_expiry:
            headers.append(_expires(expires_at))
        trailers = response.trailers
        trail = trailers is not None and "http.response.trailers" in (self.scope.get("extensions") or {})
        start = {"type": "http.response.start", "status": response.status, "headers": headers}
        if trail:
            start["trailers"] = True
        await self.send(start)
        await self.send({"type": "http.response.body", "body": response.body, "more_body": False})
        if trail:
            await self.send({"type": "http.response.trailers", "headers": list(trailers or ()), "more_trailers": False})

    # -- refusals ---------------------------------------------------------------------------------

    def _too_large(self) -> Refused:
        limit = self.route.max_body
        return Refused(problems.BODY_TOO_LARGE, f"The request body exceeds this route's limit of {limit} bytes.")

    def _store_failed(self, what: str, exc: Exception) -> None:
        self.mw.emit("store_error", self.route, self.rkey)
        if isinstance(exc, BackendMisconfigured):
            throttled(logging.ERROR, f"idem_asgi: the idempotency store refuses this app: {exc}")
        else:
            store_failed(what, exc)

    def _store_refusal(self, exc: Exception) -> Refused:
        if isinstance(exc, BackendMisconfigured):
            return Refused(problems.STORE_MISCONFIGURED, event=None)
        return Refused(problems.STORE_UNAVAILABLE, retry_after=self.route.retry_after, event=None)


EXPIRES_HEADER: Final = b"idempotency-expires"


def _expires(at: float) -> tuple[bytes, bytes]:
    return EXPIRES_HEADER, formatdate(at, usegmt=True).encode("ascii")


def _expiring(send: Send, ttl: float, released: Container[int]) -> Send:
    """`send`, adding when the stored answer will expire to the answer's start (not to what is stored).

    Only to an answer that is stored: one with a releasing status (5xx, 429, ...) leaves nothing to
    replay, and its client must not be told the server keeps its key.
    """

    async def sending(message: Message) -> None:
        if message["type"] == "http.response.start" and message["status"] not in released:
            message = {**message, "headers": [*message.get("headers", ()), _expires(time.time() + ttl)]}
        await send(message)

    return sending
