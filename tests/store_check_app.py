"""An app whose idempotency store can never work (a Postgres role without rights), for uvicorn's start-up.

`uvicorn --factory tests.store_check_app:app --lifespan on` with `IDEM_CHECK_DSN` set to such a role's DSN.
"""

from __future__ import annotations

import os

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

from idem_asgi import IdempotencyMiddleware, RoutePolicy
from idem_asgi.backends.postgres import PostgresBackend


async def pay(request: Request) -> PlainTextResponse:
    return PlainTextResponse("paid", status_code=201)


def app() -> IdempotencyMiddleware:
    backend = PostgresBackend.from_dsn(os.environ["IDEM_CHECK_DSN"], table="idem_never_created", min_size=1, max_size=1)
    inner = Starlette(routes=[Route("/payments", pay, methods=["POST"])])
    return IdempotencyMiddleware(inner, backend=backend, routes=[RoutePolicy("/payments", single_tenant=True)])
