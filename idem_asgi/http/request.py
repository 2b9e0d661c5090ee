"""One protected request, from its key to its answer: the ASGI adapter of the claim core.

read the key, find the scope -> read the body -> derive the key -> claim -> decide ->
run (capturing the answer) / replay / refuse.

The HTTP steps (key, body, scope, capture, replay, problem answers) live here; claiming,
waiting, recovering, renewing and settling are the core's (`claims.session.ClaimSession`, which
`Protected` is). Everything about one request lives on one `Protected` object, built over the
middleware's frozen `HttpRuntime`; it is also the `ClaimHandle` handlers reach through
`IdempotencyInfo` (to mark an effect, or for `PostgresBackend.transaction()` to find the claim).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Container
from dataclasses import dataclass
from datetime import UTC, datetime
from email.utils import formatdate
from typing import Final, Literal

import anyio
import msgspec

from .._logging import redact, throttled
from .._types import ASGIApp, Message, Receive, Scope, Send
from ..claims.decide import REPLAY, RUN, Action
from ..claims.session import ClaimSession, Runtime
from ..context import STATE_KEY, IdempotencyInfo, enter, leave
from ..errors import BackendMisconfigured, StoreFull, WrongAnswer
from ..records import Claimed, ClaimResult, Existing, Record, RecordKey, StoredResponse
from ..transform import AnswerTransform, seal, unseal
from . import current, problems
from .admission import Refused, parsed_key, request_scope, sentence
from .asgi import (
    HIDDEN_EXTENSIONS,
    TooLarge,
    length_over,
    read_chunks,
    replaying,
    run_unclaimed,
)
from .capture import Capture
from .fingerprint import OFFLOAD_BYTES, digest
from .keys import route_key
from .routing import Route, route_path

logger = logging.getLogger("idem_asgi")


@dataclass(frozen=True, slots=True)
class HttpRuntime(Runtime):
    """What every protected request of one middleware shares: the core's runtime, plus the app and
    what its answers and refusals are made of. The middleware builds a new one when its store or
    app is swapped; a request keeps the one it started with."""

    app: ASGIApp
    namespace: str
    fail_open: bool
    transform: AnswerTransform | None
    replay_header: tuple[bytes, bytes]
    problem_base: str


class Protected(ClaimSession):
    """The state and steps of one request on a protected route: the ASGI adapter of a claim session."""

    __slots__ = ("chunks", "key", "owner", "receive", "route", "scope", "send", "stored_owner")
    rt: HttpRuntime

    def __init__(self, rt: HttpRuntime, route: Route, scope: Scope, receive: Receive, send: Send) -> None:
        ClaimSession.__init__(self, rt, route)
        self.route = route
        self.scope = scope
        self.receive = receive
        self.send = send
        self.key = ""
        self.owner: str | None = None  # whom the key belongs to, as the handler is told
        self.stored_owner: str | None = None  # and as it is stored (a long scope is stored as its digest)
        self.chunks: list[bytes] = []  # the body as it came, never joined by us (`read_chunks`)

    # -- the steps --------------------------------------------------------------------------------

    async def handle(self) -> None:
        """Answer the request: pass it through, refuse it, replay the stored answer, or run the app once."""
        try:
            route, scope = self.route, self.scope
            given = self._given()
            if given is None and route.key_source is None:
                await self.rt.app(scope, self.receive, self.send)  # no key on a route that does not require one
                return
            # The body, in the request's own coroutine for the usual case (one message, default rule).
            message = await self.receive()
            if message["type"] == "http.request" and not message.get("more_body", False) and route.whole is not None:
                body = message.get("body", b"")
                if len(body) > route.max_body:
                    raise self._too_large()
                self.chunks = [body]
                self.fingerprint = route.whole(scope, body)
            elif not await self._read(message):
                return  # the client left before anything was claimed
            if route.key_source is None:
                assert given is not None
                self.key = given
                self.rkey = RecordKey.build(self.rt.namespace, self.stored_owner, given)
            elif not await self._derive(given):
                return
            try:
                result = await self.claim()
            except Exception as exc:
                await self._claim_failed(exc)  # refuses, or (fail-open) runs the app unclaimed
                return
            action = self.at_once(result)
            if action is RUN:
                assert isinstance(result, Claimed)
                if self.rt.observer is not None:
                    self.emit("claimed")  # (the key's history notes it in `begin`, with its token)
                await self._run(result.token)
                return
            if action is REPLAY:
                assert isinstance(result, Existing) and result.record.response is not None
                if self.rt.told:
                    self.emit("replayed")
                stored = result.record.response
                await self._replay(self._opened(stored) if stored.sealed else stored, self._until(result.record))
            else:
                await self._act(result)
        except Refused as refusal:
            if refusal.event is not None:
                self.emit(refusal.event, refusal.problem.status)
            await problems.send_problem(
                self.send,
                refusal.problem,
                refusal.detail,
                retry_after=refusal.retry_after,
                base=problems.located(self.rt.problem_base, self.scope),
                members=refusal.members,
                headers=refusal.headers,
            )

    def _given(self) -> str | None:
        """The key header, the scope and the declared length, before any body work (`Refused` if bad):
        the key given (None: none given), with `owner` and `stored_owner` set."""
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
            return None
        # The scope needs no body: a request that names nobody is refused before any body work.
        if route.scope is not None:
            self.stored_owner, self.owner = request_scope(route, scope)
        if length is not None and len(length) >= route.max_body_digits and length_over(length, route.max_body):
            raise self._too_large()
        return given

    async def _read(self, first: Message) -> bool:
        """The body in several messages, or for a rule other than the default: read it, hashed as it
        comes. False when the client left first."""
        route = self.route
        hasher = route.fingerprint.begin(self.scope)
        try:
            read = await read_chunks(self.receive, route.max_body, hasher.update, first=first)
        except TooLarge:
            raise self._too_large() from None
        if read is None:
            return False
        self.chunks = chunks = read
        size = sum(map(len, chunks))
        # (a small body's digest is taken here: `digest` only matters for a large body to parse)
        self.fingerprint = hasher.digest() if size < OFFLOAD_BYTES else await digest(hasher, size)
        return True

    async def _derive(self, given: str | None) -> bool:
        """A route whose key is derived from the request (`RoutePolicy(key=...)`): set the key, or pass
        the request through (False) when it has none and the route does not require one."""
        route, scope = self.route, self.scope
        assert route.key_source is not None
        derived = route.key_source(scope, b"".join(self.chunks), given)
        if derived is None:
            if route.required:
                raise Refused(problems.KEY_REQUIRED, "This operation needs the fields its idempotency key is made of.")
            await self.rt.app(scope, replaying(self.chunks, self.receive), self.send)
            return False
        # A derived key lives in its route's own key space: never a header key's, nor another route's.
        self.key = derived
        stored = route_key(scope["method"], route_path(scope), derived)
        self.rkey = RecordKey.build(self.rt.namespace, self.stored_owner, stored)
        return True

    async def _claim_failed(self, exc: Exception) -> None:
        """The claim raised: refuse (503, 429, 500 raise `Refused`), or with fail-open run the app unclaimed."""
        route = self.route
        if isinstance(exc, StoreFull):
            self.emit("store_error")
            problem = problems.KEY_QUOTA if exc.scope_quota else problems.STORE_UNAVAILABLE
            raise Refused(problem, sentence(str(exc)), retry_after=route.retry_after, event=None) from None
        self.store_failed("claim failed", exc)
        if self.rt.fail_open:
            receive = replaying(self.chunks, self.receive)
            await run_unclaimed(self.rt.app, self.scope, receive, self.send, self.key, self.owner)
            return
        raise self._store_refusal(exc) from None

    async def _act(self, result: ClaimResult) -> None:
        """Decide what the claim's outcome means (waiting, recovering), then run, replay or refuse."""
        route = self.route
        try:
            action, outcome = await self.decided(result, self._recover)
        except Refused:
            raise
        except WrongAnswer as exc:  # the recover hook answered something this request cannot replay
            logger.error("idem_asgi: recover hook for key %r: %s", self.key, exc)
            raise Refused(problems.OUTCOME_UNKNOWN, event="outcome_unknown") from None
        except Exception as exc:  # a store call of the recovery failed
            self.store_failed("takeover failed", exc)
            raise self._store_refusal(exc) from None
        if action is Action.RUN:
            assert isinstance(outcome, Claimed)
            await self._run(outcome.token)
        elif action is Action.REPLAY:
            if isinstance(outcome, StoredResponse):  # handed over by its holder, or recovered: just now
                await self._replay(self._opened(outcome), time.time() + (route.replay_ttl or route.ttl))
            else:
                assert isinstance(outcome, Existing) and outcome.record.response is not None
                await self._replay(self._opened(outcome.record.response), self._until(outcome.record))
        elif action is Action.MISMATCH:
            raise Refused(route.mismatch, event=None)
        elif action is Action.IN_PROGRESS:
            raise Refused(problems.IN_PROGRESS, retry_after=route.retry_after, event=None)
        elif action is Action.EXPIRED:
            raise Refused(problems.OUTCOME_UNKNOWN, event="outcome_unknown")
        elif action is Action.ANSWER_EXPIRED:
            assert isinstance(outcome, Existing)
            await self._after_horizon(outcome.record)
        else:
            raise Refused(problems.NOT_STORED, event=None)

    async def _after_horizon(self, record: Record) -> None:
        """A completed key whose answer is past the route's `replay_ttl` (shrunk to its tombstone, or
        not yet): its current state on a `replay="current"` route, else 409 `response-expired`
        saying when and how it completed. Never a run: the key refuses until its `ttl` ends."""
        response = record.response
        assert response is not None
        tomb = response if response.tombstone else response.tombstoned()
        if self.route.locate is not None and await self._current(tomb, None):
            return
        done, until = _iso(record.lease_until), _iso(record.expires_at)
        keep = self.route.replay_ttl or response.replay_for
        kept = f"was kept {keep:g} s and is gone" if keep else "is no longer kept"
        raise Refused(
            problems.RESPONSE_EXPIRED,
            f"The request with this key completed at {done} with status {tomb.status}; its answer {kept}. "
            f"The key refuses another run until {until}. Nothing ran again.",
            event=None,
            members={"completed_at": done, "completed_status": tomb.status, "expires_at": until},
            headers=list(tomb.headers),
        )

    async def _recover(self, record: Record) -> StoredResponse | Literal["run"] | None:
        """An expired lease: the route's recover hook says what happened (or `reclaim` runs it again)."""
        route, rkey = self.route, self.rkey
        assert rkey is not None
        if route.recover is not None:
            try:
                outcome = await route.recover(rkey, record)
            except Exception as exc:  # its text may carry a provider's key or token
                logger.warning(
                    "idem_asgi: recover hook failed for key %r: %s: %s", rkey.key, type(exc).__name__, redact(str(exc))
                )
                logger.debug("idem_asgi: recover hook traceback", exc_info=exc)
                return None
            return self._sealed(outcome) if isinstance(outcome, StoredResponse) else outcome
        if route.on_expired == "reclaim" and not (record.holder_failed or record.effect_committed):
            return "run"  # the holder vanished (crash, stall); a holder that failed mid-answer is never re-run
        return None

    async def _run(self, token: int) -> None:
        """Run the app once under the claim, streaming its answer while capturing it."""
        route = self.route
        self.begin(token)
        replayed = route.replay_ttl or route.ttl  # how long this answer will be replayed
        send = self.send if not route.advertise_expiry else _expiring(self.send, replayed, route.release_statuses)
        capture = Capture(send, self.receive, self.chunks, self._on_final, route.excluded, route.max_stored_body)
        info = IdempotencyInfo(self.key, self.owner, self)
        entered = enter(info)
        try:
            await self.rt.app(self._app_scope(info), capture.receive, capture)
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
                self.stop()
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

    def _on_final(self, response: StoredResponse) -> Awaitable[object]:
        """The app sent its whole answer: store it (or release the claim), before its last chunk goes
        out. Returns the store write to await (not a coroutine of its own: one frame less per request)."""
        self.stop()
        if response.status in self.route.release_statuses:
            return self.end(response.status, keep=self.effect)
        if self.route.replay_ttl is not None:  # its bytes are replayed this long; the key refuses for its ttl
            response = msgspec.structs.replace(response, replay_for=self.route.replay_ttl)
        if self.rt.transform is None:
            return self.complete(response, response.status)
        try:
            sealed = self._sealed(response)
        except Exception as exc:  # the client still gets its answer; the claim stays, as after a failed write
            self.ended(None)
            self.emit("store_error", response.status)
            key = self.key
            throttled(logging.ERROR, f"idem_asgi: the answer transform failed; key {key!r} not stored: {exc!r}")
            return _nothing()
        return self.complete(sealed, response.status)

    async def _unfinished(self, capture: Capture, *, cancelled: bool) -> None:
        """The app raised, was cancelled, or returned without finishing its answer.

        The answer had started (or an effect was marked): the operation may have happened, so a
        retry must never run it again; the record ends outcome-unknown at once. Cancelled before
        anything was answered: like a crash, the claim is kept and its lease ends."""
        self.stop()
        status = capture.status if capture.started else None
        keep = self.effect or (capture.started and capture.status not in self.route.release_statuses)
        await self.end(status, keep=keep, release=not cancelled)

    def _sealed(self, response: StoredResponse) -> StoredResponse:
        """The answer as the store keeps it (the middleware's `transform`, marked sealed)."""
        return seal(self.rt.transform, response)

    def _opened(self, response: StoredResponse) -> StoredResponse:
        """A stored answer as it is replayed; a sealed one this server cannot open is a misconfiguration."""
        if not response.sealed:
            return response  # stored in clear (also before the transform was turned on): as it was stored
        try:
            return unseal(self.rt.transform, response)
        except Exception as exc:
            throttled(logging.ERROR, f"idem_asgi: the answer transform cannot read a stored answer: {exc!r}")
            raise Refused(
                problems.STORE_MISCONFIGURED, "A stored answer cannot be read with this server's transform."
            ) from None

    async def _replay(self, response: StoredResponse, expires_at: float) -> None:
        """Send the stored answer verbatim, marked as a replay (and, if asked, when it expires); on a
        `replay="current"` route, the current state of what it made when the app can show it."""
        route = self.route
        if route.locate is not None:
            if await self._current(response, expires_at):
                return
            response = msgspec.structs.replace(response, headers=[*response.headers, current.STORED])
        headers = [*response.headers, self.rt.replay_header]
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

    def _until(self, record: Record) -> float:
        """Until when a completed record's answer is replayed: its expiry, or its `replay_ttl` sooner."""
        keep = self.route.replay_ttl
        return record.expires_at if keep is None else min(record.expires_at, record.lease_until + keep)

    async def _current(self, response: StoredResponse, expires_at: float | None) -> bool:
        """Answer with the current state of what `response` made; False when there is none to give."""
        route = self.route
        assert route.locate is not None
        fetched = await current.fetch_current(
            self.rt.app, self.scope, response, route.locate, route.header, route.max_stored_body
        )
        if fetched is None:
            return False
        headers, body = fetched
        headers = [(k, v) for k, v in headers if k not in route.excluded]
        headers += [(k, v) for k, v in response.headers if k == b"location"]
        headers += [(b"content-length", str(len(body)).encode("ascii")), current.CURRENT, self.rt.replay_header]
        if route.advertise_expiry and expires_at is not None:  # (past its replay_ttl: none to advertise)
            headers.append(_expires(expires_at))
        await self.send({"type": "http.response.start", "status": response.status, "headers": headers})
        await self.send({"type": "http.response.body", "body": body, "more_body": False})
        return True

    # -- refusals ---------------------------------------------------------------------------------

    def _too_large(self) -> Refused:
        limit = self.route.max_body
        return Refused(problems.BODY_TOO_LARGE, f"The request body exceeds this route's limit of {limit} bytes.")

    def _store_refusal(self, exc: Exception) -> Refused:
        if isinstance(exc, BackendMisconfigured):
            return Refused(problems.STORE_MISCONFIGURED, event=None)
        return Refused(problems.STORE_UNAVAILABLE, retry_after=self.route.retry_after, event=None)


async def _nothing() -> None:
    """Nothing to write."""


EXPIRES_HEADER: Final = b"idempotency-expires"


def _iso(at: float) -> str:
    """An instant as RFC 3339 UTC, to the second."""
    return datetime.fromtimestamp(at, UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


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
