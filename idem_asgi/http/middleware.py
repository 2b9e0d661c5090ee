"""IdempotencyMiddleware: configuration, and the dispatch of each request to pass through or protection.

No storage code lives here (that is `backends`), no decision logic (`claims.decide`) and no
per-request state: a protected request's steps live on its own `http.request.Protected` object,
built over the middleware's frozen `HttpRuntime` (what it needs, never the middleware itself).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Final, Literal

from .. import _shared
from .._logging import once
from .._types import ASGIApp, Message, Receive, Scope, Send
from ..backends import Backend, Checkable, Watchable
from ..claims.late_writes import LateWrites
from ..claims.waiting import Waiters
from ..errors import BackendMisconfigured, ConfigurationError
from ..observe import Observer
from ..transform import AnswerTransform
from . import problem_pages, problems
from .admission import header_key
from .asgi import run_unclaimed
from .keys import ScopeFunc
from .policy import RecoverHook, RoutePolicy
from .request import HttpRuntime, Protected
from .routing import Route, RouteTable, route_path

logger = logging.getLogger("idem_asgi")

_COMPRESSORS: Final = frozenset(
    {"GZipMiddleware", "BrotliMiddleware", "CompressionMiddleware", "ZstdMiddleware", "GZipResponder"}
)
MAX_NAMESPACE_LENGTH: Final = 200


class IdempotencyMiddleware:
    """Pure ASGI middleware giving protected requests at-most-once effect and byte-identical replays.

    Args:
        app: The ASGI application to protect.
        backend: A store (`MemoryBackend()`, `RedisBackend`, `PostgresBackend`) or a URL
            (`memory://`, `redis://...`, `postgresql://...`; one store per URL per process, shared by
            every middleware given it). Defaults to a memory store, shared by every middleware built
            from the same `routes` list (frameworks that build one middleware per handler do that).
        routes: The route policies; a request matching none passes through untouched.
        header: Name of the key header (per-route override: `RoutePolicy.header`).
        scope: Callable from the ASGI scope to the key's owner (tenant, user); e.g. `scope_from_user()`.
        strict: Refuse to start (ConfigurationError) when a route has no scope callable and is not
            declared `single_tenant`; False logs a warning instead.
        namespace: Prefix separating several apps that share one store.
        on_store_error: `fail_closed` answers 503 when the store fails; `fail_open` runs the app unprotected.
        recover: Default recovery hook for expired leases (per-route override: `RoutePolicy.recover`).
        replay_header: Header added to replays.
        observer: Called with an `Event` at each decision (`idem_asgi.observe`: counters, logs,
            Prometheus, OpenTelemetry); its exceptions are logged and ignored.
        transform: Applied to answers on their way into the store and back (`idem_asgi.transform`:
            `EncryptBody(fernet.encrypt, fernet.decrypt)`), so no response body sits in the store
            in clear; None stores them verbatim.
        problem_base: What the problem `type`s are built from (`<base><slug>`). Default
            `urn:idem-asgi:problem:`, identifiers that locate nothing. A path of this app (e.g.
            `"/problems/"`) makes the middleware serve each problem's page there itself; an absolute
            http(s) URL points at your own docs. Either way, refusals also carry
            `Link: <type>; rel="describedby"`.
    """

    def __init__(
        self,
        app: ASGIApp,
        *,
        backend: Backend | str | None = None,
        routes: Sequence[RoutePolicy] = (),
        header: str = "Idempotency-Key",
        scope: ScopeFunc | None = None,
        strict: bool = True,
        namespace: str = "idem",
        on_store_error: Literal["fail_closed", "fail_open"] = "fail_closed",
        recover: RecoverHook | None = None,
        replay_header: str = "Idempotent-Replayed",
        observer: Observer | None = None,
        problem_base: str = problems.DEFAULT_PROBLEM_BASE,
        transform: AnswerTransform | None = None,
    ) -> None:
        self.app = app
        if transform is not None and not isinstance(transform, AnswerTransform):
            raise ConfigurationError(f"transform {transform!r} needs store(response) and load(response) methods")
        self.transform = transform
        self.problem_base = problems.check_base(problem_base)
        self._pages = problems.served(self.problem_base)
        self._observer = observer
        self.backend: Backend = _shared.backend_for(backend, routes)
        if on_store_error not in ("fail_closed", "fail_open"):
            raise ConfigurationError(f"on_store_error must be 'fail_closed' or 'fail_open', got {on_store_error!r}")
        self.fail_open = on_store_error == "fail_open"
        if not namespace or len(namespace) > MAX_NAMESPACE_LENGTH:
            raise ConfigurationError(f"namespace must be 1 to {MAX_NAMESPACE_LENGTH} characters, got {namespace!r}")
        self.namespace = namespace
        self.table = RouteTable(routes, header=header, scope=scope, recover=recover)
        self.replay_header = (replay_header.lower().encode("latin-1"), b"true")
        self.runtime = self._runtime()
        self._check_scoping(strict)
        self._check_compression()
        self._disabled = os.environ.get("IDEM_ASGI_DISABLED", "").strip().lower() in ("1", "true", "yes", "on")
        if self._disabled:
            # Read once, here (Starlette/FastAPI build their middleware at the first request): every
            # request passes through unclaimed. For users' unrelated tests (`idem_disabled` fixture).
            once(
                logging.WARNING,
                "idem_asgi: IDEM_ASGI_DISABLED is set: idempotency is OFF for every request",
            )

    def _check_scoping(self, strict: bool) -> None:
        for r in self.routes:
            if r.unscoped:
                message = (
                    f"idem_asgi: route {r.policy.path!r} has no scope callable, so every caller would share one key "
                    "space (one tenant could read another's stored answers). Pass scope=... (e.g. "
                    "scope_from_user()) or declare RoutePolicy(single_tenant=True)"
                )
                if strict:
                    raise ConfigurationError(message + "; strict=False only warns")
                once(logging.WARNING, message)

    def _check_compression(self) -> None:
        """Warn when a compressor sits between us and the app: we would store (and replay) its bytes."""
        inner: Any = self.app
        for _ in range(32):
            if inner is None:
                return
            if type(inner).__name__ in _COMPRESSORS:
                once(
                    logging.WARNING,
                    f"idem_asgi: {type(inner).__name__} runs inside IdempotencyMiddleware, so compressed bytes would "
                    "be stored and replayed to clients that may not accept them; add the compressor outside it",
                )
                return
            inner = getattr(inner, "app", None)

    def _runtime(self) -> HttpRuntime:
        """What each protected request is handed (rebuilt when the store or the app is swapped): the
        store's one machinery in this process (lease renewer, late writes, held repeats), shared
        with the jobs and consumers that claim in the same store."""
        return HttpRuntime.of(
            self.backend,
            self._observer,
            self.app,
            self.namespace,
            self.fail_open,
            self.transform,
            self.replay_header,
            self.problem_base,
        )

    @property
    def late(self) -> LateWrites:
        """The store's writes being retried (ends of claims the store did not take at first)."""
        return self.runtime.late

    @property
    def waiters(self) -> Waiters:
        """Repeats held on `wait=` routes, woken by their holder in this process."""
        return self.runtime.waiters

    @property
    def routes(self) -> tuple[Route, ...]:
        """The compiled route policies, in the order given."""
        return self.table.routes

    @property
    def policies(self) -> list[RoutePolicy]:
        """The route policies, as given (used by `add_openapi`)."""
        return [r.policy for r in self.routes]

    def use_backend(self, backend: Backend) -> Backend:
        """Serve from `backend` from now on and return the store used before (test tools wrap it).

        Requests from now on claim, renew and settle in `backend`; one already running finishes in
        the store it claimed in (every write of one claim goes to one store).
        """
        previous, self.backend = self.backend, backend
        self.runtime = self._runtime()
        return previous

    @property
    def watcher(self) -> Watchable | None:
        """The store, if it can tell this process when a claim ends (asked once, when it is set)."""
        return self.runtime.watcher

    def use_app(self, app: ASGIApp) -> ASGIApp:
        """Protect `app` from now on and return the app protected before (test tools wrap it)."""
        previous, self.app = self.app, app
        self.runtime = self._runtime()
        return previous

    def route_for(self, method: str, path: str) -> Route | None:
        """The compiled policy protecting `method` on `path` (relative to the mount), or None."""
        return self.table.match(path, method.upper())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            if scope["type"] == "lifespan":
                send = self._lifespan_send(send)
            await self.app(scope, receive, send)
            return
        if self._pages and await problem_pages.serve(self.problem_base, scope, send):
            return
        route = self.table.lookup(scope)
        if route is None:
            await self.app(scope, receive, send)
            return
        if self._disabled:
            await self._unclaimed(route, scope, receive, send)
            return
        await Protected(self.runtime, route, scope, receive, send).handle()

    async def _unclaimed(self, route: Route, scope: Scope, receive: Receive, send: Send) -> None:
        """Disabled: run the app with nothing claimed, but still hand it the key, so handlers that read it work."""
        try:
            key = header_key(route, scope)
            owner = route.scope(scope) if route.scope is not None else None
        except Exception:
            key = owner = None
        if key is None:
            await self.app(scope, receive, send)
        else:
            await run_unclaimed(self.app, scope, receive, send, key, owner if isinstance(owner, str) else None)

    def _lifespan_send(self, send: Send) -> Send:
        """Check the store when the app has started: a store that can never work fails the start-up."""

        async def lifespan_send(message: Message) -> None:
            if message["type"] == "lifespan.startup.complete":
                problem = await self.check_store()
                if problem is not None:
                    await send({"type": "lifespan.startup.failed", "message": problem})
                    return
            await send(message)

        return lifespan_send

    async def check_store(self) -> str | None:
        """`check_store(self.backend)`: run at lifespan start-up."""
        return await check_store(self.backend)


async def check_store(backend: Backend) -> str | None:
    """Ask the store whether it can serve (`backend.check()` where it has one).

    Returns None when it can (or is merely unreachable now: that is an outage, answered 503 per
    request until it is back), or the message of a configuration it can never work with, which
    is also logged as an error.
    """
    if not isinstance(backend, Checkable):
        return None
    try:
        await backend.check()
    except (BackendMisconfigured, ConfigurationError) as exc:
        message = f"idem_asgi: the idempotency store refuses this app: {exc}"
        logger.error(message)
        return message
    except Exception as exc:
        logger.warning(
            "idem_asgi: the idempotency store is unreachable at start-up (%s); protected "
            "requests get 503 until it is back",
            exc,
        )
    return None


def startup_check(backend: Backend) -> Callable[[], Awaitable[None]]:
    """The middleware's start-up check as a hook, for frameworks whose middleware never sees the
    lifespan (Litestar: `on_startup=[startup_check(backend)]`): it raises `BackendMisconfigured`
    for a store that can never work (the start-up fails) and only logs one that is down now."""

    async def check() -> None:
        problem = await check_store(backend)
        if problem is not None:
            raise BackendMisconfigured(problem)

    return check


__all__ = ["IdempotencyMiddleware", "check_store", "route_path", "startup_check"]
