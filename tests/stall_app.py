"""The app the store-stall scenario (tests/test_store_stall.py) runs under uvicorn.

Two protected routes on one store, the same handler behind both:
- `POST /hook`: `RoutePolicy(recover=...)` with the hook of docs/operations.md's worked example as
  it answers when the provider does not know the key: `"run"`. Every call of the hook is counted
  (`INCR <run>:hook:<key>` in the shared Redis) before it answers.
- `POST /plain`: no hook (the default `block`: an expired claim answers `409 outcome-unknown`).

The handler counts its execution in the shared Redis (`INCR <run>:effect:<key>`, the ground truth:
the shared Redis is never the stalled store), sleeps `IDEM_STALL_DELAY` s, and answers 201 with a
fresh uuid. `GET /health` answers `{"pid": ...}`. Every answer carries `x-worker: <pid>` (added outside
the middleware, so never stored).

Environment: `IDEM_STALL_STORE` (the store's URL: `redis://` or `postgresql://`), `IDEM_STALL_SHARED`
(the counters' Redis, default the shared one), `IDEM_STALL_RUN` (counter prefix and namespace),
`IDEM_STALL_LEASE`, `IDEM_STALL_DELAY`, `IDEM_STALL_TIMEOUT` (the store's per-call timeout, s),
`IDEM_STALL_TABLE` (Postgres). The app is built at lifespan start-up; importing this module does
nothing else.
"""

from __future__ import annotations

import asyncio
import json
import os
import uuid
from typing import TYPE_CHECKING, Literal

from idem_asgi import IdempotencyMiddleware, RoutePolicy
from idem_asgi.records import Record, RecordKey, StoredResponse
from tests.support.servers import REDIS_URL, UvicornProcess

if TYPE_CHECKING:
    from pathlib import Path

    import redis.asyncio as aioredis

    from idem_asgi._types import ASGIApp, Message, Receive, Scope, Send
    from idem_asgi.backends import Backend
    from idem_asgi.http.policy import RecoverHook

TABLE = "idem_stall_records"


def counter(run: str, what: Literal["effect", "hook"], key: str) -> str:
    """The shared-Redis name of a counter: `what` happened to `key` in `run`."""
    return f"idem-stall:{run}:{what}:{key}"


def make_store(url: str, *, prefix: str, timeout: float, table: str = TABLE) -> Backend:
    """The stalled store: Redis keys under `prefix`, or the Postgres `table`; each call bounded by `timeout`."""
    if url.startswith(("postgres://", "postgresql://")):
        from idem_asgi.backends.postgres import PostgresBackend

        return PostgresBackend.from_dsn(url, table=table, timeout=timeout, min_size=1, max_size=20)
    from idem_asgi.backends.redis import RedisBackend

    return RedisBackend.from_url(url, prefix=prefix, timeout=timeout)


class Handler:
    """POST: count the execution, sleep, 201 with a fresh id. GET /health: the pid."""

    def __init__(self, shared: aioredis.Redis, run: str, delay: float) -> None:
        self.shared = shared
        self.run = run
        self.delay = delay

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        while (await receive()).get("more_body", False):
            pass
        if scope["method"] != "POST":
            await _answer(send, 200, json.dumps({"pid": os.getpid()}).encode())
            return
        key = next(v for k, v in scope["headers"] if k == b"idempotency-key").decode()
        await self.shared.incr(counter(self.run, "effect", key))
        await asyncio.sleep(self.delay)
        body = json.dumps({"key": key, "payment": uuid.uuid4().hex, "pid": os.getpid()}).encode()
        await _answer(send, 201, body)


async def _answer(send: Send, status: int, body: bytes) -> None:
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class Tagged:
    """Outside the middleware: every answer names the worker that sent it (`x-worker: <pid>`), so a
    retry answered by a worker that does not hold the key can be told from one answered by its holder."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.pid = str(os.getpid()).encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def tagged(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), (b"x-worker", self.pid)]}
            await send(message)

        await self.app(scope, receive, tagged)


def build(store: Backend, shared: aioredis.Redis, *, run: str, lease: float, delay: float) -> ASGIApp:
    """The middleware over the handler: `/hook` with the counting recover hook, `/plain` without."""

    async def recover(key: RecordKey, record: Record) -> StoredResponse | Literal["run"] | None:
        await shared.incr(counter(run, "hook", key.key))
        return "run"  # the provider has never seen this key

    def route(path: str, hook: RecoverHook | None) -> RoutePolicy:
        return RoutePolicy(
            path, methods=["POST"], required=True, single_tenant=True, lease=lease, ttl=120, recover=hook
        )

    routes = [route("/hook", recover), route("/plain", None)]
    protected = IdempotencyMiddleware(
        Handler(shared, run, delay), backend=store, routes=routes, namespace=f"stall-{run}"
    )
    return Tagged(protected)


class _LazyApp:
    """The uvicorn entry point: builds everything from the environment at lifespan start-up."""

    def __init__(self) -> None:
        self.app: ASGIApp | None = None
        self.store: Backend | None = None
        self.shared: aioredis.Redis | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "lifespan":
            assert self.app is not None, "lifespan start-up did not run"
            await self.app(scope, receive, send)
            return
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                import redis.asyncio as aioredis

                env = os.environ
                run = env["IDEM_STALL_RUN"]
                self.shared = aioredis.Redis.from_url(env.get("IDEM_STALL_SHARED", REDIS_URL))
                self.store = make_store(
                    env["IDEM_STALL_STORE"],
                    prefix=f"idem-stall:{run}:",
                    timeout=float(env.get("IDEM_STALL_TIMEOUT", "2")),
                    table=env.get("IDEM_STALL_TABLE", TABLE),
                )
                lease, delay = float(env["IDEM_STALL_LEASE"]), float(env["IDEM_STALL_DELAY"])
                self.app = build(self.store, self.shared, run=run, lease=lease, delay=delay)
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self.store is not None:
                    await self.store.aclose()
                if self.shared is not None:
                    await self.shared.aclose()
                await send({"type": "lifespan.shutdown.complete"})
                return


app = _LazyApp()


def launch(env: dict[str, str], log: Path, *, workers: int) -> UvicornProcess:
    """`uvicorn tests.stall_app:app` on 127.0.0.1 in its own process group; always stopped by the caller."""
    args = ["--lifespan", "on", "--timeout-graceful-shutdown", "3"]
    return UvicornProcess("tests.stall_app:app", env, log, workers=workers, args=args)
