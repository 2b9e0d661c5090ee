"""The floors the overhead benchmark measures ours against, in the same rounds.

- `Forward`: an ASGI middleware that only forwards (`await app(scope, receive, send)`): what any
  middleware layer costs, so the noise of a run shows beside the numbers.
- `Capture`: the least an idempotency middleware can do in Python: buffer the body, SHA-256 it,
  one dict lookup by key, replay a stored answer, or wrap `send`, capture the answer and store it.
  No policies, scopes, leases, fencing, problem answers or store round trips: what is left of
  ours once everything that makes it correct is taken away. A memory-store ratio close to this
  one means the rest of ours costs little.
- `Naive`: the naive Redis idempotency middleware a team writes in an afternoon, on redis-py:
  `SET key NX` to claim, then a second `SET` with the captured answer (two round trips per new
  key; a repeat reads the key back). No fencing, leases, scopes or fingerprint check: correct
  enough for a demo, and what ours on Redis must beat by a clear margin to be worth its weight.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Any

from idem_asgi._types import ASGIApp, Message, Receive, Scope, Send


def _key_on(scope: Scope, path: str) -> bytes | None:
    """The request's idempotency key when it is an HTTP request to `path` (else it passes through)."""
    if scope["type"] != "http" or scope["path"] != path:
        return None
    return next((v for k, v in scope["headers"] if k == b"idempotency-key"), None)


class Forward:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.app(scope, receive, send)


class Capture:
    def __init__(self, app: ASGIApp, path: str = "/noop") -> None:
        self.app = app
        self.path = path
        self.stored: dict[bytes, tuple[bytes, list[Message]]] = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        key = _key_on(scope, self.path)
        if key is None:
            await self.app(scope, receive, send)
            return
        chunks = []
        more = True
        while more:
            message = await receive()
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = b"".join(chunks)
        digest = hashlib.sha256(body).digest()
        hit = self.stored.get(key)
        if hit is not None and hit[0] == digest:
            for message in hit[1]:
                await send(message)
            return
        sent: list[Message] = []
        given = False

        async def replay_body() -> Message:
            nonlocal given
            if given:
                return await receive()
            given = True
            return {"type": "http.request", "body": body, "more_body": False}

        async def capture(message: Message) -> None:
            sent.append(message)
            await send(message)

        await self.app(scope, replay_body, capture)
        self.stored[key] = (digest, sent)


class Naive:
    def __init__(self, app: ASGIApp, url: str, prefix: str, path: str = "/noop") -> None:
        import redis.asyncio as redis

        self.app = app
        self.path = path
        self.prefix = prefix
        pool = redis.BlockingConnectionPool.from_url(url, max_connections=64, timeout=5)
        self.redis = redis.Redis(connection_pool=pool)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        key = _key_on(scope, self.path)
        if key is None:
            await self.app(scope, receive, send)
            return
        name = self.prefix + key.decode()
        if not await self.redis.set(name, b"", nx=True, ex=86_400):  # round trip 1: claim
            stored = await self.redis.get(name)
            if stored:
                start, body = json.loads(stored)
                await send(
                    {
                        "type": "http.response.start",
                        "status": start[0],
                        "headers": [
                            *((k.encode("latin-1"), v.encode("latin-1")) for k, v in start[1]),
                            (b"idempotent-replayed", b"true"),
                        ],
                    }
                )
                await send({"type": "http.response.body", "body": body.encode("latin-1")})
            else:
                await send({"type": "http.response.start", "status": 409, "headers": []})
                await send({"type": "http.response.body", "body": b""})
            return
        status, headers, chunks = 0, [], []

        async def capture(message: Message) -> None:
            nonlocal status, headers
            if message["type"] == "http.response.start":
                status, headers = (
                    message["status"],
                    [(k.decode("latin-1"), v.decode("latin-1")) for k, v in message.get("headers", ())],
                )
            elif message["type"] == "http.response.body":
                chunks.append(message.get("body", b""))
            await send(message)

        await self.app(scope, receive, capture)
        answer = json.dumps([[status, headers], b"".join(chunks).decode("latin-1")])
        await self.redis.set(name, answer, ex=86_400)  # round trip 2: store the answer


def add_floor(name: str, app: Any) -> Any:
    """Put the floor called `name` (`capture`, `forward` or `naive`) where ours sits: FastAPI's
    `app.add_middleware`, inside Starlette's outermost layers. So a replay pays the framework's
    entry on both sides, and what is read over a floor is ours alone."""
    if name == "capture":
        app.add_middleware(Capture)
    elif name == "forward":
        app.add_middleware(Forward)
    elif name == "naive":
        url = os.environ.get("IDEM_BENCH_REDIS_URL", "redis://127.0.0.1:6379/0")
        app.add_middleware(Naive, url=url, prefix=os.environ.get("IDEM_BENCH_PREFIX", "idem-bench:") + "naive:")
    else:
        raise SystemExit(f"unknown floor {name!r}: capture, forward or naive")
    return app
