"""IdempotencyMiddleware: match a policy, claim the key, then run, replay or refuse.

No storage code lives here (that is `backends`), and no decision logic (that is `_decide`).
The middleware object is shared by every request; per-request state lives in locals.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Sequence
from typing import Literal

import anyio

from . import problems
from ._capture import Capture
from ._decide import Action, decide
from ._late_completions import LateCompletions
from ._types import ASGIApp, Message, Receive, Scope, Send
from .backends import Backend, backend_from_url
from .backends.memory import MemoryBackend
from .context import STATE_KEY, IdempotencyInfo, _current
from .errors import BackendError, ConfigurationError
from .fingerprint import RawBody
from .keys import MalformedKey, ScopeFunc, parse_key, storable_scope
from .observe import Event, EventName, Observer
from .policy import RecoverHook, RoutePolicy, compile_path, seconds
from .records import Claimed, ClaimResult, Existing, Record, RecordKey, StoredResponse

logger = logging.getLogger("idem_asgi")

_HIDDEN_EXTENSIONS = ("http.response.pathsend", "http.response.zerocopysend")


_EVENT_OF: dict[Action, EventName] = {
    Action.RUN: "claimed",
    Action.REPLAY: "replayed",
    Action.MISMATCH: "mismatch",
    Action.IN_PROGRESS: "conflict",
    Action.NOT_STORED: "not_stored",
    Action.EXPIRED: "expired",
}


class _Route:
    """A RoutePolicy compiled once: everything the hot path needs, precomputed."""

    __slots__ = (
        "exact",
        "excluded",
        "fingerprint",
        "header",
        "header_name",
        "key_source",
        "lease",
        "max_body",
        "max_stored_body",
        "methods",
        "on_expired",
        "policy",
        "recover",
        "regex",
        "release_statuses",
        "required",
        "retry_after",
        "scope",
        "ttl",
        "wait",
    )

    def __init__(self, policy: RoutePolicy, header: str, scope: ScopeFunc | None, recover: RecoverHook | None) -> None:
        self.policy = policy
        self.exact, self.regex = compile_path(policy.path)
        # A bare string is one method: iterating "POST" would protect "P", "O", "S" and "T".
        methods = (policy.methods,) if isinstance(policy.methods, str) else policy.methods
        self.methods = frozenset(m.upper() for m in methods)
        if not self.methods:
            raise ConfigurationError(f"route {policy.path!r} protects no method")
        self.header_name = policy.header or header
        self.header = self.header_name.lower().encode("latin-1")
        self.ttl = seconds(policy.ttl)
        self.lease = seconds(policy.lease)
        if self.lease > self.ttl:
            raise ConfigurationError(f"route {policy.path!r}: lease ({self.lease}s) exceeds ttl ({self.ttl}s)")
        self.wait = 0.0 if policy.wait is None else seconds(policy.wait)
        self.required = policy.required
        self.max_body = policy.max_body
        self.max_stored_body = policy.max_stored_body
        self.release_statuses = policy.release_statuses
        self.key_source = policy.key
        self.fingerprint = policy.fingerprint or getattr(policy.key, "fingerprint", None) or RawBody()
        self.scope = policy.scope or scope
        self.recover = policy.recover or recover
        self.on_expired = policy.on_expired
        if self.on_expired not in ("block", "reclaim"):
            raise ConfigurationError(f"on_expired must be 'block' or 'reclaim', got {self.on_expired!r}")
        self.retry_after = policy.retry_after
        excluded = (policy.excluded_headers,) if isinstance(policy.excluded_headers, str) else policy.excluded_headers
        self.excluded = frozenset(h.lower().encode("latin-1") for h in excluded)


class IdempotencyMiddleware:
    """Pure ASGI middleware giving protected requests at-most-once effect and byte-identical replays.

    Args:
        app: The ASGI application to protect.
        backend: A store (`MemoryBackend()`, `RedisBackend`, `PostgresBackend`) or a URL
            (`memory://`, `redis://...`, `postgresql://...`). Defaults to a per-process memory store.
        routes: The route policies; a request matching none passes through untouched.
        header: Name of the key header (per-route override: `RoutePolicy.header`).
        scope: Callable from the ASGI scope to the key's owner (tenant, user); None means unscoped.
        strict: Refuse to start when a route has no scope callable and is not declared single-tenant.
        namespace: Prefix separating several apps that share one store.
        on_store_error: `fail_closed` answers 503 when the store fails; `fail_open` runs the app unprotected.
        recover: Default recovery hook for expired leases (per-route override: `RoutePolicy.recover`).
        replay_header: Header added to replays.
        observer: Called with an `Event` at each decision (`idem_asgi.observe`: counters, logs,
            Prometheus, OpenTelemetry); its exceptions are logged and ignored.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        backend: Backend | str | None = None,
        routes: Sequence[RoutePolicy] = (),
        header: str = "Idempotency-Key",
        scope: ScopeFunc | None = None,
        strict: bool = False,
        namespace: str = "idem",
        on_store_error: Literal["fail_closed", "fail_open"] = "fail_closed",
        recover: RecoverHook | None = None,
        replay_header: str = "Idempotent-Replayed",
        observer: Observer | None = None,
    ) -> None:
        self.app = app
        self._observer = observer
        if backend is None:
            backend = MemoryBackend()
        elif isinstance(backend, str):
            backend = backend_from_url(backend)
        if not isinstance(backend, Backend):
            raise ConfigurationError(f"{backend!r} does not implement the idem_asgi Backend protocol")
        self.backend: Backend = backend
        if on_store_error not in ("fail_closed", "fail_open"):
            raise ConfigurationError(f"on_store_error must be 'fail_closed' or 'fail_open', got {on_store_error!r}")
        self.fail_open = on_store_error == "fail_open"
        self.namespace = namespace
        self.routes = [_Route(p, header, scope, recover) for p in routes]
        self._replay_header = (replay_header.lower().encode("latin-1"), b"true")
        self._exact: dict[str, list[_Route]] = {}
        self._patterns: list[_Route] = []
        for r in self.routes:
            if r.exact is not None:
                self._exact.setdefault(r.exact, []).append(r)
            else:
                self._patterns.append(r)
        self._methods = frozenset().union(*(r.methods for r in self.routes)) if self.routes else frozenset()
        self._leases = _Leases(self.backend, self._emit, min((r.lease for r in self.routes), default=30.0) / 3)
        self._late = LateCompletions(self.backend)
        for r in self.routes:
            if r.scope is None and not r.policy.single_tenant:
                message = (
                    f"idem_asgi: route {r.policy.path!r} has no scope callable, so all callers share one key space; "
                    "pass scope=... or declare RoutePolicy(single_tenant=True)"
                )
                if strict:
                    raise ConfigurationError(message)
                logger.warning(message)
        self._disabled = os.environ.get("IDEM_ASGI_DISABLED", "").strip().lower() in ("1", "true", "yes", "on")
        if self._disabled:
            # Read once, here (Starlette/FastAPI build their middleware at the first request): every
            # request passes through unclaimed. For users' unrelated tests (`idem_disabled` fixture).
            logger.warning("idem_asgi: IDEM_ASGI_DISABLED is set: idempotency is OFF, every request passes through")

    def _emit(
        self, name: EventName, route: _Route, rkey: RecordKey | None = None, status: int | None = None
    ) -> None:
        if self._observer is None:
            return
        try:
            key, owner = (None, None) if rkey is None else (rkey.key, rkey.scope or None)
            self._observer(Event(name, route.policy.path, key, owner, status))
        except Exception:
            logger.exception("idem_asgi: observer failed on %r", name)

    @property
    def policies(self) -> list[RoutePolicy]:
        """The route policies, as given (used by `add_openapi`)."""
        return [r.policy for r in self.routes]

    def _match(self, path: str, method: str) -> _Route | None:
        for r in self._exact.get(path, ()):
            if method in r.methods:
                return r
        for r in self._patterns:
            if method in r.methods and r.regex is not None and r.regex.fullmatch(path):
                return r
        return None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in self._methods:
            await self.app(scope, receive, send)
            return
        route = self._match(scope["path"], scope["method"])
        if route is None:
            await self.app(scope, receive, send)
            return
        if self._disabled:
            await self._unclaimed(route, scope, receive, send)
            return
        await self._protect(route, scope, receive, send)

    async def _unclaimed(self, route: _Route, scope: Scope, receive: Receive, send: Send) -> None:
        """Disabled: run the app with nothing claimed, but still hand it the key, so handlers that read it work."""
        raw = next((v for k, v in scope["headers"] if k == route.header), None)
        try:
            key = None if raw is None else parse_key(raw)
        except MalformedKey:
            key = None
        if key is not None:
            info = IdempotencyInfo(key=key, scope=route.scope(scope) if route.scope is not None else None)
            scope = {**scope, "state": {**scope.get("state", {}), STATE_KEY: info}}
            reset = _current.set(info)
            try:
                await self.app(scope, receive, send)
            finally:
                _current.reset(reset)
            return
        await self.app(scope, receive, send)

    async def _protect(self, route: _Route, scope: Scope, receive: Receive, send: Send) -> None:
        raw: bytes | None = None
        count = 0
        declared: bytes | None = None
        for k, v in scope["headers"]:
            if k == route.header:
                raw = v
                count += 1
            elif k == b"content-length":
                declared = v
        key: str | None = None
        if count > 1:
            self._emit("rejected", route, status=400)
            await problems.send_problem(
                send, problems.KEY_MALFORMED, f"Send exactly one {route.header_name} header, not {count}."
            )
            return
        if raw is not None:
            try:
                key = parse_key(raw)
            except MalformedKey as exc:
                self._emit("rejected", route, status=400)
                await problems.send_problem(send, problems.KEY_MALFORMED, str(exc)[:1].upper() + str(exc)[1:] + ".")
                return
        elif route.key_source is None:
            if route.required:
                self._emit("rejected", route, status=400)
                await problems.send_problem(
                    send, problems.KEY_REQUIRED, f"This operation requires an {route.header_name} header."
                )
            else:
                await self.app(scope, receive, send)
            return
        if declared is not None and declared.isdigit() and int(declared) > route.max_body:
            await self._too_large(route, send)
            return

        hasher = route.fingerprint.begin(scope)
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # http.disconnect: the client left before anything was claimed
            chunk = message.get("body", b"")
            if chunk:
                size += len(chunk)
                if size > route.max_body:
                    await self._too_large(route, send)
                    return
                hasher.update(chunk)
                chunks.append(chunk)
            if not message.get("more_body", False):
                break
        fingerprint = hasher.digest()
        body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        if route.key_source is not None:
            key = route.key_source(scope, body, key)
            if key is None:
                if route.required:
                    self._emit("rejected", route, status=400)
                    await problems.send_problem(
                        send, problems.KEY_REQUIRED, "This operation needs the fields its idempotency key is made of."
                    )
                else:
                    await self.app(scope, _replaying(body, receive), send)
                return

        assert key is not None  # a header key, or a derived one (both checked above)
        owner = route.scope(scope) if route.scope is not None else None
        if owner is not None and not storable_scope(owner):
            self._emit("rejected", route, status=400)
            await problems.send_problem(
                send, problems.SCOPE_MALFORMED, "The value records are scoped by holds a NUL or is not valid Unicode."
            )
            return
        rkey = RecordKey.build(self.namespace, owner, key)
        try:
            result = await self.backend.claim(rkey, fingerprint, lease=route.lease, ttl=route.ttl)
        except Exception as exc:
            _store_failed("claim failed", exc)
            self._emit("store_error", route, rkey)
            if self.fail_open:
                await self.app(scope, _replaying(body, receive), send)
            else:
                await self._unavailable(route, send)
            return
        await self._act(route, scope, receive, send, rkey, owner, fingerprint, body, result)

    async def _act(
        self,
        route: _Route,
        scope: Scope,
        receive: Receive,
        send: Send,
        rkey: RecordKey,
        owner: str | None,
        fingerprint: bytes,
        body: bytes,
        result: ClaimResult,
    ) -> None:
        action = decide(result, fingerprint)
        if action is Action.IN_PROGRESS and route.wait:
            result = await self._wait(route, rkey, fingerprint, result)
            action = decide(result, fingerprint)
        self._emit(_EVENT_OF[action], route, rkey)
        if action is Action.RUN:
            assert isinstance(result, Claimed)
            await self._run(route, scope, receive, send, rkey, owner, body, result.token)
        elif action is Action.REPLAY:
            assert isinstance(result, Existing) and result.record.response is not None
            await self._replay(send, result.record.response)
        elif action is Action.MISMATCH:
            await problems.send_problem(
                send,
                problems.FINGERPRINT_MISMATCH,
                "This idempotency key was already used for a different request (method, path, query or body).",
            )
        elif action is Action.IN_PROGRESS:
            await problems.send_problem(
                send,
                problems.IN_PROGRESS,
                "The first request with this key is still running; retry after the indicated delay.",
                retry_after=route.retry_after,
            )
        elif action is Action.NOT_STORED:
            await problems.send_problem(
                send,
                problems.NOT_STORED,
                "The request with this key completed, but its response was too large to store; "
                "fetch the current state of the resource instead of retrying.",
            )
        else:
            assert isinstance(result, Existing)
            await self._expired(route, scope, receive, send, rkey, owner, fingerprint, body, result.record)

    async def _wait(self, route: _Route, rkey: RecordKey, fingerprint: bytes, result: ClaimResult) -> ClaimResult:
        """Re-claim with backoff until the first request ends or `route.wait` runs out."""
        delay = 0.01
        with anyio.move_on_after(route.wait):
            while decide(result, fingerprint) is Action.IN_PROGRESS:
                await anyio.sleep(delay)
                delay = min(delay * 2, 0.25)
                try:
                    result = await self.backend.claim(rkey, fingerprint, lease=route.lease, ttl=route.ttl)
                except Exception as exc:
                    _store_failed("claim failed while waiting", exc)
                    self._emit("store_error", route, rkey)
                    break
        return result

    async def _expired(
        self,
        route: _Route,
        scope: Scope,
        receive: Receive,
        send: Send,
        rkey: RecordKey,
        owner: str | None,
        fingerprint: bytes,
        body: bytes,
        record: Record,
    ) -> None:
        outcome: StoredResponse | Literal["run"] | None = None
        if route.recover is not None:
            try:
                outcome = await route.recover(rkey, record)
            except Exception:
                logger.exception("idem_asgi: recover hook failed for key %r", rkey.key)
                outcome = None
        elif route.on_expired == "reclaim":
            outcome = "run"
        if outcome is None:
            self._emit("outcome_unknown", route, rkey)
            await problems.send_problem(
                send,
                problems.OUTCOME_UNKNOWN,
                "A request with this key started but its server stopped before finishing; its outcome is "
                "being reconciled. Check the resource's state before trying again.",
            )
            return
        try:
            taken = await self.backend.takeover(rkey, record.token, fingerprint, lease=route.lease, ttl=route.ttl)
            if isinstance(taken, Claimed):
                self._emit("recovered", route, rkey)
            if isinstance(taken, Claimed) and not isinstance(outcome, str):
                await self.backend.complete(rkey, taken.token, outcome, ttl=route.ttl)
                await self._replay(send, outcome)
                return
        except Exception as exc:
            _store_failed("takeover failed", exc)
            self._emit("store_error", route, rkey)
            await self._unavailable(route, send)
            return
        if isinstance(taken, Existing) and decide(taken, fingerprint) is Action.EXPIRED:
            await problems.send_problem(
                send, problems.IN_PROGRESS, "The request is being recovered.", retry_after=route.retry_after
            )
            return
        await self._act(route, scope, receive, send, rkey, owner, fingerprint, body, taken)

    async def _run(
        self,
        route: _Route,
        scope: Scope,
        receive: Receive,
        send: Send,
        rkey: RecordKey,
        owner: str | None,
        body: bytes,
        token: int,
    ) -> None:
        backend = self.backend
        renewal = self._leases.hold(route, rkey, token)

        async def on_final(response: StoredResponse) -> None:
            renewal.stop()
            if response.status in route.release_statuses:
                await self._release(route, rkey, token, response.status)
                return
            try:
                stored = await backend.complete(rkey, token, response, ttl=route.ttl)
            except Exception as exc:
                self._emit("store_error", route, rkey, response.status)
                # The effect happened and the client gets its answer. Never release: retry the write
                # in the background; if it never lands, the lease expires into outcome-unknown.
                _store_failed(f"could not store the answer for key {rkey.key!r}; retrying in the background", exc)
                status = response.status
                if not self._late.retry(rkey, token, response, route.ttl, lambda n: self._emit(n, route, rkey, status)):
                    logger.error("idem_asgi: too many answers waiting for the store; key %r is not retried", rkey.key)
                return
            if stored:
                self._emit("completed", route, rkey, response.status)
            else:
                logger.warning("idem_asgi: key %r was taken over; this answer was not stored", rkey.key)
                self._emit("lease_lost", route, rkey, response.status)

        capture = Capture(send, on_final, excluded=route.excluded, limit=route.max_stored_body)
        info = IdempotencyInfo(key=rkey.key, scope=owner)
        app_scope = dict(scope)
        app_scope["state"] = {**scope.get("state", {}), STATE_KEY: info}
        extensions = scope.get("extensions")
        if extensions and any(e in extensions for e in _HIDDEN_EXTENSIONS):
            app_scope["extensions"] = {k: v for k, v in extensions.items() if k not in _HIDDEN_EXTENSIONS}
        reset = _current.set(info)
        try:
            await self.app(app_scope, _holding_disconnect(body, receive, capture), capture)
        except Exception:
            renewal.stop()
            if not capture.finished:
                with anyio.CancelScope(shield=True):
                    await self._release(route, rkey, token)
            raise
        except BaseException:
            # Cancelled mid-flight: the effect may or may not have happened. Keep the claim; its
            # lease expires into outcome-unknown rather than letting a retry run it twice.
            renewal.stop()
            raise
        finally:
            capture.wake()
            _current.reset(reset)
        renewal.stop()
        if not capture.finished:
            await self._release(route, rkey, token)

    async def _release(self, route: _Route, rkey: RecordKey, token: int, status: int | None = None) -> None:
        try:
            released = await self.backend.release(rkey, token)
        except Exception:
            self._emit("store_error", route, rkey, status)
            logger.exception("idem_asgi: could not release key %r; it stays in progress until its lease ends", rkey.key)
            return
        if released:
            self._emit("released", route, rkey, status)
        else:
            logger.warning("idem_asgi: key %r was taken over; it was not released", rkey.key)
            self._emit("lease_lost", route, rkey, status)

    async def _replay(self, send: Send, response: StoredResponse) -> None:
        headers = list(response.headers)
        headers.append(self._replay_header)
        await send({"type": "http.response.start", "status": response.status, "headers": headers})
        await send({"type": "http.response.body", "body": response.body, "more_body": False})

    async def _too_large(self, route: _Route, send: Send) -> None:
        self._emit("rejected", route, status=413)
        await problems.send_problem(
            send, problems.BODY_TOO_LARGE, f"The request body exceeds this route's limit of {route.max_body} bytes."
        )

    async def _unavailable(self, route: _Route, send: Send) -> None:
        await problems.send_problem(
            send,
            problems.STORE_UNAVAILABLE,
            "The idempotency store cannot be reached, so the request was not run; retry later.",
            retry_after=route.retry_after,
        )


def _store_failed(what: str, exc: Exception) -> None:
    """Log a store failure: one line for an outage (no stack trace flood), a traceback for anything else."""
    if isinstance(exc, BackendError):
        logger.warning("idem_asgi: %s: %s", what, exc)
    else:
        logger.error("idem_asgi: %s", what, exc_info=exc)


def _replaying(body: bytes, receive: Receive) -> Receive:
    """A `receive` that hands the app the buffered body once, then the real channel (disconnects)."""
    sent = False

    async def replay() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replay


def _holding_disconnect(body: bytes, receive: Receive, capture: Capture) -> Receive:
    """Like `_replaying`, but an `http.disconnect` reaches the app only once its answer is complete.

    The contract says a client that hangs up does not stop the operation: the app finishes and
    its answer is stored. Apps that stop at a disconnect (Starlette's `StreamingResponse` under
    ASGI < 2.4 cancels its stream) would otherwise return with half an answer, the claim would
    be released, and the retry would run the operation a second time.
    """
    sent = False
    gone = False

    async def replay() -> Message:
        nonlocal sent, gone
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        if not gone:
            message = await receive()
            if message["type"] != "http.disconnect":
                return message
            gone = True
        await capture.wait_finished()
        return {"type": "http.disconnect"}

    return replay


class _Leases:
    """The claims this middleware holds while their apps run; one timer renews the long-running ones.

    Holding a claim is a dict insert and releasing it a dict pop: no timer (`call_later` +
    `cancel`) and no closure per request. While anything is held, one timer ticks every third of
    the shortest route lease and extends each claim last extended a third of its own lease ago,
    so a live claim is extended at most two thirds of its lease after the previous extension.
    """

    __slots__ = ("_backend", "_emit", "_held", "_loop", "_tasks", "_tick", "_timer")

    def __init__(
        self, backend: Backend, emit: Callable[[EventName, _Route, RecordKey | None], None], tick: float
    ) -> None:
        self._backend = backend
        self._emit = emit
        self._tick = tick
        self._held: dict[int, _Renewal] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: set[asyncio.Task[None]] = set()

    def hold(self, route: _Route, key: RecordKey, token: int) -> _Renewal:
        loop = asyncio.get_running_loop()
        renewal = _Renewal(self._held, route, key, token, loop.time() + route.lease / 3)
        self._held[id(renewal)] = renewal
        if self._timer is None or self._loop is not loop:
            # the first claim since a tick found nothing held, or a new event loop (tests)
            self._loop = loop
            self._timer = loop.call_later(self._tick, self._fire)
        return renewal

    def _fire(self) -> None:
        loop = self._loop
        assert loop is not None
        now = loop.time()
        for renewal in list(self._held.values()):
            if renewal.due <= now:
                renewal.due = now + renewal.route.lease / 3
                task = loop.create_task(self._extend(renewal))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)
        self._timer = loop.call_later(self._tick, self._fire) if self._held else None

    async def _extend(self, renewal: _Renewal) -> None:
        route, key = renewal.route, renewal.key
        try:
            held = await self._backend.extend(key, renewal.token, lease=route.lease)
        except Exception as exc:
            _store_failed(f"could not extend the lease of key {key.key!r}; will retry", exc)
            self._emit("store_error", route, key)
            return  # still held: the next tick tries again
        if not renewal.held:
            return  # the app finished meanwhile
        if held:
            self._emit("lease_extended", route, key)
        else:
            renewal.stop()
            logger.warning("idem_asgi: lease of key %r was lost while the app ran", key.key)
            self._emit("lease_lost", route, key)


class _Renewal:
    """One claim held while its app runs; `stop()` (idempotent) when the app is done with it."""

    __slots__ = ("_held", "due", "key", "route", "token")

    def __init__(self, held: dict[int, _Renewal], route: _Route, key: RecordKey, token: int, due: float) -> None:
        self._held = held
        self.route = route
        self.key = key
        self.token = token
        self.due = due

    @property
    def held(self) -> bool:
        return self._held.get(id(self)) is self

    def stop(self) -> None:
        if self._held.get(id(self)) is self:
            del self._held[id(self)]
