"""The app the crash matrix and the multi-worker storms run under uvicorn, and the helper that runs it.

POST /pay behind `IdempotencyMiddleware`; GET /health answers `{"pid": ...}`. The handler records
each execution in a ledger OUTSIDE the middleware (Redis INCR or a Postgres row per execution),
sleeps, and answers 201 with a fresh uuid in two body chunks (so "mid-send" exists).

A worker SIGKILLs itself (`os.kill(os.getpid(), SIGKILL)`) at the crash point named by
`IDEM_CRASH_POINT`. Every crash point is injected from the outside of idem_asgi:

| point               | where                                                                          |
|---------------------|--------------------------------------------------------------------------------|
| `before_claim`      | outer ASGI middleware, before IdempotencyMiddleware is called                  |
| `after_claim`       | Backend wrapper: `claim` returned `Claimed`                                    |
| `mid_handler`       | the handler, right after its ledger write                                      |
| `before_store`      | Backend wrapper: start of `complete` (handler done, answer not stored)         |
| `after_store`       | Backend wrapper: `complete` returned (answer stored, nothing sent yet)         |
| `before_first_send` | wrapper of the server's `send`, outside the middleware: `http.response.start`  |
|                     | is held back and the worker dies on the final body message (stored, nothing sent)|
| `mid_send`          | same wrapper: the worker dies right after the first body chunk went out        |

The worker dies once `IDEM_CRASH_AFTER` requests have reached the point (a barrier, so several
keys die at the very same point), or `IDEM_CRASH_WAIT` seconds after the first one did.

Other variables: `IDEM_CRASH_BACKEND` (store URL), `IDEM_CRASH_NAMESPACE` (middleware namespace and
Redis key prefix), `IDEM_CRASH_TABLE` (Postgres table), `IDEM_CRASH_LEDGER` (ledger URL),
`IDEM_CRASH_RUN` (ledger run id), `IDEM_CRASH_LEASE`, `IDEM_CRASH_TTL`, `IDEM_CRASH_DELAY`
(handler sleep, s), `IDEM_CRASH_POOL` (connection pool size per worker, for the store and the ledger each),
`IDEM_CRASH_ON_EXPIRED` (the route's recovery policy, `block` (default) or `reclaim`),
`IDEM_CRASH_FAIL_KEYS` (a key prefix: the handler answers 500 instead of 201 to keys that start with
it, after its ledger write and sleep, so the middleware releases the claim), `IDEM_CRASH_TRACE` (a
file: every store call after the claim's result is appended to it as one JSON line: op, key,
token, result, wall time; see `Tracer`), `IDEM_CRASH_RESEED` (set: the app seeds the global
`random` generator as careless apps do, `random.seed(7)` at import and `random.seed(42)` in the
handler on every call). Unset, each behaves as before they existed.

Importing this module has no other side effect: the app is built at lifespan start-up.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Literal, TypeVar

from idem_asgi import IdempotencyMiddleware, RoutePolicy
from idem_asgi._types import ASGIApp, Message, Receive, Scope, Send
from idem_asgi.backends import Backend
from idem_asgi.records import Claimed, ClaimResult, RecordKey, StoredResponse
from tests.support.scorecard import Ledger, ledger_from_url
from tests.support.servers import UvicornProcess
from tests.support.stores import Delegating, store_from_url

POINTS = (
    "before_claim",
    "after_claim",
    "mid_handler",
    "before_store",
    "after_store",
    "before_first_send",
    "mid_send",
)
R = TypeVar("R", bound="ClaimResult | None")
RESEED = bool(os.environ.get("IDEM_CRASH_RESEED"))
if RESEED:
    random.seed(7)  # at import, in every worker: what an app (or a library it imports) may do


class Crasher:
    """Kills this process when `after` requests reached `point` (or `wait` s after the first did)."""

    def __init__(self, point: str = "none", after: int = 1, wait: float = 3.0) -> None:
        if point != "none" and point not in POINTS:
            raise ValueError(f"unknown crash point {point!r}")
        self.point = point
        self.after = after
        self.wait = wait
        self.arrived = 0

    async def reached(self, point: str) -> None:
        if point != self.point:
            return
        self.arrived += 1
        if self.arrived >= self.after:
            self.die()
        await asyncio.sleep(self.wait)
        self.die()

    def die(self) -> None:
        os.write(2, f"crash_app: SIGKILL at {self.point} ({self.arrived} requests there)\n".encode())
        os.kill(os.getpid(), signal.SIGKILL)


Trace = Callable[[dict[str, Any]], None]


class Tracer:
    """A `Trace` that appends each store call as one JSON line to a file (read by the test that set it)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __call__(self, entry: dict[str, Any]) -> None:
        line = (json.dumps(entry) + "\n").encode()
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            os.write(fd, line)  # one write of one short line with O_APPEND: never interleaved
        finally:
            os.close(fd)


def read_trace(path: Path) -> list[dict[str, Any]]:
    """The entries a `Tracer` wrote (none when the file does not exist)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in text.splitlines() if line.strip()]


class CrashingBackend(Delegating):
    """The Backend protocol around a real store, with crash points around claim and complete.

    With `trace`, every call is reported (after it returned) as `{"op", "key", "token", "result",
    "sent", "at", "pid"}`: `token` is the fencing token the call carried (claim, takeover: the token
    it got or found), `result` True/False for the fenced writes, `claimed`/`existing` for claims
    (`gone` for a takeover of a record that no longer exists), or `error` when the store failed;
    `sent` and `at` are the wall-clock times the call was made and returned.
    """

    def __init__(self, inner: Backend, crasher: Crasher, trace: Trace | None = None) -> None:
        super().__init__(inner)
        self.crasher = crasher
        self.trace = trace

    def _trace(self, op: str, key: RecordKey, token: int | None, result: object, sent: float) -> None:
        if self.trace is not None:
            entry = {"op": op, "key": key.key, "token": token, "result": result, "sent": sent, "at": time.time()}
            self.trace({**entry, "pid": os.getpid()})

    async def _claimed(self, op: str, key: RecordKey, call: Awaitable[R]) -> R:
        """Await a claim or takeover, then report it: the token it got or found."""
        sent = time.time()
        try:
            result = await call
        except Exception:
            self._trace(op, key, None, "error", sent)
            raise
        if result is None:
            self._trace(op, key, None, "gone", sent)
        elif isinstance(result, Claimed):
            self._trace(op, key, result.token, "claimed", sent)
        else:
            self._trace(op, key, result.record.token, "existing", sent)
        return result

    async def _written(self, op: str, key: RecordKey, token: int, call: Awaitable[bool]) -> bool:
        """Await a fenced write, then report it: True, False, or `error`."""
        sent = time.time()
        try:
            done = await call
        except Exception:
            self._trace(op, key, token, "error", sent)
            raise
        self._trace(op, key, token, done, sent)
        return done

    async def setup(self) -> None:
        setup = getattr(self.inner, "setup", None)
        if setup is not None:
            await setup()

    async def claim(self, key: RecordKey, fingerprint: bytes, *, lease: float, ttl: float) -> ClaimResult:
        result = await self._claimed("claim", key, self.inner.claim(key, fingerprint, lease=lease, ttl=ttl))
        if isinstance(result, Claimed):
            await self.crasher.reached("after_claim")
        return result

    async def takeover(
        self, key: RecordKey, stale_token: int, fingerprint: bytes, *, lease: float, ttl: float
    ) -> ClaimResult | None:
        call = self.inner.takeover(key, stale_token, fingerprint, lease=lease, ttl=ttl)
        return await self._claimed("takeover", key, call)

    async def complete(self, key: RecordKey, token: int, response: StoredResponse, *, ttl: float) -> bool:
        await self.crasher.reached("before_store")
        stored = await self._written("complete", key, token, self.inner.complete(key, token, response, ttl=ttl))
        await self.crasher.reached("after_store")
        return stored

    async def release(self, key: RecordKey, token: int) -> bool:
        return await self._written("release", key, token, self.inner.release(key, token))

    async def extend(self, key: RecordKey, token: int, *, lease: float) -> bool:
        return await self._written("extend", key, token, self.inner.extend(key, token, lease=lease))


class Handler:
    """POST /pay: ledger write, sleep, 201 with a fresh id in two chunks. GET /health: the pid.

    A key starting with `fail_keys` (when set) is answered 500 instead, with the same body shape.
    """

    def __init__(self, ledger: Ledger, crasher: Crasher, delay: float, fail_keys: str | None = None) -> None:
        self.ledger = ledger
        self.crasher = crasher
        self.delay = delay
        self.fail_keys = fail_keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        while (await receive()).get("more_body", False):
            pass
        if scope["path"] != "/pay":
            await self._answer(send, 200, json.dumps({"pid": os.getpid()}).encode())
            return
        key = next(v for k, v in scope["headers"] if k == b"idempotency-key").decode()
        if RESEED:
            random.seed(42)
        await self.ledger.incr(key)
        await self.crasher.reached("mid_handler")
        if self.delay:
            await asyncio.sleep(self.delay)
        body = json.dumps({"key": key, "payment": uuid.uuid4().hex, "pid": os.getpid()}).encode()
        failed = self.fail_keys is not None and key.startswith(self.fail_keys)
        await self._answer(send, 500 if failed else 201, body)

    @staticmethod
    async def _answer(send: Send, status: int, body: bytes) -> None:
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        half = len(body) // 2
        await send({"type": "http.response.body", "body": body[:half], "more_body": True})
        await send({"type": "http.response.body", "body": body[half:], "more_body": False})


class CrashGate:
    """Outer ASGI middleware (outside IdempotencyMiddleware): crashes before the claim, or in `send`."""

    def __init__(self, app: ASGIApp, crasher: Crasher) -> None:
        self.app = app
        self.crasher = crasher

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] == "/pay":
            await self.crasher.reached("before_claim")
            if self.crasher.point in ("before_first_send", "mid_send"):
                send = self._wrap(send)
        await self.app(scope, receive, send)

    def _wrap(self, send: Send) -> Send:
        crasher = self.crasher
        held: list[Message] = []
        chunks = 0

        async def crashing_send(message: Message) -> None:
            nonlocal chunks
            if crasher.point == "before_first_send":
                if message["type"] == "http.response.body" and not message.get("more_body", False):
                    await crasher.reached("before_first_send")  # the store write happened just before this
                held.append(message)  # nothing reaches the server before the crash
                return
            await send(message)
            if message["type"] == "http.response.body":
                chunks += 1
                if chunks == 1 and message.get("more_body", False):
                    await crasher.reached("mid_send")

        return crashing_send


def make_store(url: str, *, namespace: str, table: str, pool: int, history: int = 0) -> Backend:
    """The store at `url`, Redis keys under `idem-rel:<namespace>:` (where `cleanup_store` finds them);
    `history` steps kept per key (`IDEM_CRASH_HISTORY`)."""
    return store_from_url(url, prefix=f"idem-rel:{namespace}:", table=table, pool=pool, history=history)


def build(
    store: Backend,
    ledger: Ledger,
    *,
    namespace: str,
    point: str = "none",
    after: int = 1,
    wait: float = 3.0,
    lease: float = 1.0,
    ttl: float = 300.0,
    delay: float = 0.02,
    on_expired: Literal["block", "reclaim"] = "block",
    fail_keys: str | None = None,
    trace: Trace | None = None,
) -> tuple[ASGIApp, CrashingBackend]:
    """The whole stack, outermost first: CrashGate -> IdempotencyMiddleware(CrashingBackend) -> Handler."""
    crasher = Crasher(point, after, wait)
    backend = CrashingBackend(store, crasher, trace)
    policy = RoutePolicy(
        "/pay", methods=["POST"], required=True, single_tenant=True, lease=lease, ttl=ttl, on_expired=on_expired
    )
    protected = IdempotencyMiddleware(
        Handler(ledger, crasher, delay, fail_keys), backend=backend, routes=[policy], namespace=namespace
    )
    return CrashGate(protected, crasher), backend


class _LazyApp:
    """The uvicorn entry point: builds everything from the environment at lifespan start-up."""

    def __init__(self) -> None:
        self.app: ASGIApp | None = None
        self.backend: CrashingBackend | None = None
        self.ledger: Ledger | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "lifespan":
            assert self.app is not None, "lifespan start-up did not run"
            await self.app(scope, receive, send)
            return
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                env = os.environ
                namespace = env.get("IDEM_CRASH_NAMESPACE", "crash")
                pool = int(env.get("IDEM_CRASH_POOL", "16"))
                store = make_store(
                    env.get("IDEM_CRASH_BACKEND", "redis://127.0.0.1:6379/0"),
                    namespace=namespace,
                    table=env.get("IDEM_CRASH_TABLE", "idem_reliability_records"),
                    pool=pool,
                    history=int(env.get("IDEM_CRASH_HISTORY", "0")),
                )
                ledger_url = env.get("IDEM_CRASH_LEDGER", "redis://127.0.0.1:6379/0")
                self.ledger = ledger_from_url(ledger_url, env["IDEM_CRASH_RUN"], pool=pool)
                self.app, self.backend = build(
                    store,
                    self.ledger,
                    namespace=namespace,
                    point=env.get("IDEM_CRASH_POINT", "none"),
                    after=int(env.get("IDEM_CRASH_AFTER", "1")),
                    wait=float(env.get("IDEM_CRASH_WAIT", "3")),
                    lease=float(env.get("IDEM_CRASH_LEASE", "1")),
                    ttl=float(env.get("IDEM_CRASH_TTL", "300")),
                    delay=float(env.get("IDEM_CRASH_DELAY", "0.02")),
                    on_expired="reclaim" if env.get("IDEM_CRASH_ON_EXPIRED") == "reclaim" else "block",
                    fail_keys=env.get("IDEM_CRASH_FAIL_KEYS") or None,
                    trace=Tracer(env["IDEM_CRASH_TRACE"]) if env.get("IDEM_CRASH_TRACE") else None,
                )
                await self.backend.setup()
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self.backend is not None:
                    await self.backend.aclose()
                if self.ledger is not None:
                    await self.ledger.aclose()
                await send({"type": "lifespan.shutdown.complete"})
                return


app = _LazyApp()


# -- running it -----------------------------------------------------------------------------------


def launch(env: dict[str, str], log: Path, *, workers: int = 1) -> UvicornProcess:
    """`uvicorn tests.crash_app:app` on 127.0.0.1 in its own process group; always stopped by the caller."""
    args = ["--lifespan", "on", "--timeout-graceful-shutdown", "5"]
    return UvicornProcess("tests.crash_app:app", env, log, workers=workers, args=args)
