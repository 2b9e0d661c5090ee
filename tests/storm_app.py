"""The app the multi-process storm runs under uvicorn: POST /pay behind IdempotencyMiddleware;
any other path (GET /health) answers `{"ok": true, "pid": ...}`.

Configured by environment variables (set by tests/test_multiprocess_storm.py):

- `IDEM_STORM_BACKEND`: the idempotency store URL (`redis://...` or `postgresql://...`).
- `IDEM_STORM_NAMESPACE`: the middleware namespace (and Redis key prefix), unique per run.
- `IDEM_STORM_COUNTER_URL`: the Redis that counts executions (the ground truth across processes).
- `IDEM_STORM_COUNTER`: prefix of the per-key counters (`INCR <prefix><key>`).
- `IDEM_STORM_DURABLE`: Redis `durable_replicas` (unset: `from_url`'s default for the URL).

The handler counts, sleeps 20 ms, and answers 201 with a fresh uuid, so a second execution or a
replay that is not byte for byte the first answer shows up at once.
"""

from __future__ import annotations

import asyncio
import json
import os
import uuid
from typing import Any

import redis.asyncio as aioredis

from idem_asgi import IdempotencyMiddleware, RoutePolicy
from idem_asgi._types import Receive, Scope, Send
from idem_asgi.backends import Backend

BACKEND_URL = os.environ.get("IDEM_STORM_BACKEND", "redis://127.0.0.1:6379/0")
NAMESPACE = os.environ.get("IDEM_STORM_NAMESPACE", "storm")
COUNTER_URL = os.environ.get("IDEM_STORM_COUNTER_URL", "redis://127.0.0.1:6379/0")
COUNTER = os.environ.get("IDEM_STORM_COUNTER", "idem-storm:")


def make_backend() -> Backend:
    if BACKEND_URL.startswith("memory://"):  # per-process: the negative control that must fail the storm
        from idem_asgi.backends import MemoryBackend

        return MemoryBackend()
    if BACKEND_URL.startswith(("postgres://", "postgresql://")):
        from idem_asgi.backends.postgres import PostgresBackend

        return PostgresBackend.from_dsn(BACKEND_URL, table="idem_storm_records", min_size=1, max_size=10)
    from idem_asgi.backends.redis import RedisBackend

    durable = os.environ.get("IDEM_STORM_DURABLE")  # replicas that must confirm claims (unset: the default)
    options: dict[str, Any] = {} if durable is None else {"durable_replicas": int(durable)}
    return RedisBackend.from_url(BACKEND_URL, prefix=f"idem-storm:{NAMESPACE}:", max_connections=64, **options)


class Handler:
    """POST /pay: count the execution for the key, sleep, answer 201 with a random id."""

    def __init__(self) -> None:
        self.counter: Any = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        while (await receive()).get("more_body", False):
            pass
        if scope["path"] != "/pay":
            await self._answer(send, 200, json.dumps({"ok": True, "pid": os.getpid()}).encode())
            return
        key = next(v for k, v in scope["headers"] if k == b"idempotency-key").decode()
        await self.counter.incr(COUNTER + key)
        await asyncio.sleep(0.02)
        body = json.dumps({"key": key, "payment": uuid.uuid4().hex, "pid": os.getpid()}).encode()
        await self._answer(send, 201, body)

    @staticmethod
    async def _answer(send: Send, status: int, body: bytes) -> None:
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})


handler = Handler()
backend = make_backend()
protected = IdempotencyMiddleware(
    handler,
    backend=backend,
    routes=[RoutePolicy("/pay", methods=["POST"], required=True, single_tenant=True, ttl=600)],
    namespace=NAMESPACE,
)


async def app(scope: Scope, receive: Receive, send: Send) -> None:
    """The ASGI entry point: lifespan opens and closes the store and the counter client."""
    if scope["type"] != "lifespan":
        await protected(scope, receive, send)
        return
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            pool = aioredis.BlockingConnectionPool.from_url(COUNTER_URL, max_connections=64, timeout=10)
            handler.counter = aioredis.Redis.from_pool(pool)
            setup = getattr(backend, "setup", None)
            if setup is not None:
                await setup()
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await backend.aclose()
            if handler.counter is not None:
                await handler.counter.aclose()
            await send({"type": "lifespan.shutdown.complete"})
            return
