"""The shop of docs/operations.md's worked example, served by uvicorn for tests/test_ops_by_key.py.

A Starlette app whose POST /payments charges the provider by `provider_key(user, key)` and answers
as `find_payment` renders it; the middleware is added by the page's own code (the worked example,
exactly as printed), and an auth middleware outside it sets `scope["user"]` from `x-user`.
With `IDEM_OPS_HOLD` set the handler blocks (the worker is then SIGKILLed): keys starting with
`never` before the charge, any other key after it. The store: `IDEM_OPS_BACKEND` (a Redis URL
with `IDEM_OPS_PREFIX`, or a Postgres DSN with `IDEM_OPS_TABLE`); `IDEM_ASGI_KEY_SECRET` as the
deployment sets it (or not). Each execution is counted under `ops:<run>:ran`.
"""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from idem_asgi._types import ASGIApp, Receive, Scope, Send
from idem_asgi.backends.postgres import PostgresBackend
from idem_asgi.backends.redis import RedisBackend
from tests.support.ops_shop import page_blocks, yours
from tests.support.snippets import compile_snippet

HOLD = bool(os.environ.get("IDEM_OPS_HOLD"))
page: dict[str, Any] = yours()


async def pay(request: Request) -> Response:
    key = request.headers["idempotency-key"]
    user = request.scope["user"]
    await request.body()
    shared = page["provider"].client
    await shared.sadd(f"ops:{os.environ['IDEM_OPS_RUN']}:entered", key)
    if HOLD and key.startswith("never"):
        await asyncio.Event().wait()  # dies here, before the charge
    charge = await page["provider"].charge(idempotency_key=page["provider_key"](user, key))
    await shared.hincrby(f"ops:{os.environ['IDEM_OPS_RUN']}:ran", key, 1)
    if HOLD:
        await asyncio.Event().wait()  # dies here: charged, no answer stored
    body = json.dumps({"charge": {"id": charge.id, "status": charge.status}}).encode()
    return Response(body, 200, media_type="application/json")


async def health(request: Request) -> Response:
    return JSONResponse({"pid": os.getpid()})


class UserFromHeader:
    """The auth middleware the page assumes: `scope["user"]` for `scope_from_user()`."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            user = dict(scope["headers"]).get(b"x-user")
            scope = {**scope, "user": None if user is None else user.decode()}
        await self.app(scope, receive, send)


def store() -> RedisBackend | PostgresBackend:
    url = os.environ["IDEM_OPS_BACKEND"]
    if url.startswith("redis"):
        return RedisBackend.from_url(url, prefix=os.environ["IDEM_OPS_PREFIX"])
    return PostgresBackend.from_dsn(url, table=os.environ["IDEM_OPS_TABLE"], min_size=1, max_size=4)


app = Starlette(routes=[Route("/payments", pay, methods=["POST"]), Route("/health", health)])
page.update(app=app, backend=store())
example, _ = page_blocks()
exec(compile_snippet(example, "docs/operations.md (worked example)"), page)  # adds the middleware
app.add_middleware(UserFromHeader)  # outside it: added last
