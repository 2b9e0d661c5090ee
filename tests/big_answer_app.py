"""The app of the big-answer scenario (tests/test_redis_big_answers.py), run under uvicorn.

`POST /big` answers `IDEM_BIG_SIZE` bytes (its route's `max_stored_body` raised to 64 MiB, so the
answer is stored and replayed); `POST /small` a few bytes. Both on one `RedisBackend` (prefix
`IDEM_BIG_PREFIX`, a 2 s timeout), so their store calls share its connections. `GET /health`
answers `{"pid": ...}`. Each run of `/big` is counted (`INCR <prefix>runs` on the shared Redis).
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING

import redis.asyncio as aioredis

from idem_asgi import IdempotencyMiddleware, RoutePolicy
from idem_asgi.backends import RedisBackend
from tests.support.servers import REDIS_URL

if TYPE_CHECKING:
    from idem_asgi._types import Receive, Scope, Send

PREFIX = os.environ.get("IDEM_BIG_PREFIX", "idem-big:")
BIG = b"b" * int(os.environ.get("IDEM_BIG_SIZE", str(32 << 20)))
counters = aioredis.Redis.from_url(REDIS_URL)


async def inner(scope: Scope, receive: Receive, send: Send) -> None:
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    while (await receive()).get("more_body"):
        pass
    if scope["path"] == "/health":
        body = json.dumps({"pid": os.getpid()}).encode()
    elif scope["path"] == "/big":
        await counters.incr(f"{PREFIX}runs")
        body = BIG
    else:
        body = b'{"ok":true}'
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 201 if scope["method"] == "POST" else 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


app = IdempotencyMiddleware(
    inner,
    backend=RedisBackend.from_url(REDIS_URL, prefix=PREFIX, timeout=2.0),
    routes=[
        RoutePolicy("/big", methods=["POST"], ttl=600, single_tenant=True, max_stored_body=64 << 20),
        RoutePolicy("/small", methods=["POST"], ttl=600, single_tenant=True),
    ],
)
