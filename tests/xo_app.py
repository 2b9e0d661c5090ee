"""The worker the exactly-once test runs under uvicorn (and SIGKILLs): a FastAPI ledger app.

Configured by environment variables set by tests/test_postgres_exactly_once.py:
`IDEM_XO_DSN`, `IDEM_XO_RECORDS` (idempotency table), `IDEM_XO_LEDGER` (business table),
`IDEM_XO_APP_NAME` (application_name of every connection, so the test can watch them).

- POST /pay writes its ledger row through `backend.transaction()`, so the row and the claim's
  "effect committed" mark commit together; the route's recover hook is `recover_uncommitted`.
- POST /naive writes its ledger row on its own (autocommit) with `on_expired="reclaim"`: the
  negative control, which a kill after the write makes run twice.

`x-hang: in-transaction` or `x-hang: after-commit` makes a request stop there (to be killed).
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import asyncpg
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from idem_asgi import IdempotencyMiddleware, RoutePolicy
from idem_asgi.backends.postgres import PostgresBackend

DSN = os.environ.get("IDEM_XO_DSN", "postgresql://postgres@127.0.0.1:5432/test")
RECORDS = os.environ.get("IDEM_XO_RECORDS", "idem_xo_records")
LEDGER = os.environ.get("IDEM_XO_LEDGER", "idem_xo_ledger")
APP_NAME = os.environ.get("IDEM_XO_APP_NAME", "idem-xo")
LEASE = 1.0

backend = PostgresBackend.from_dsn(
    DSN, table=RECORDS, min_size=1, max_size=10, server_settings={"application_name": APP_NAME}
)


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    yield
    await backend.aclose()


api = FastAPI(lifespan=lifespan)


async def hang(request: Request, where: str) -> None:
    if request.headers.get("x-hang") == where:
        await asyncio.sleep(120)


def answer(key: str) -> JSONResponse:
    return JSONResponse({"key": key, "pid": os.getpid(), "id": uuid.uuid4().hex}, status_code=201)


@api.get("/health")
async def health() -> dict[str, int]:
    return {"pid": os.getpid()}


@api.post("/pay")
async def pay(request: Request) -> JSONResponse:
    body = await request.json()
    key = request.state.idempotency.key
    async with backend.transaction() as conn:
        await conn.execute(
            f"INSERT INTO {LEDGER} (key, amount, pid) VALUES ($1, $2, $3)", key, body["amount"], os.getpid()
        )
        await hang(request, "in-transaction")
    await hang(request, "after-commit")
    return answer(key)


@api.post("/naive")
async def naive(request: Request) -> JSONResponse:
    body = await request.json()
    key = request.state.idempotency.key
    # (no statement cache: the DSN may be a transaction-mode PgBouncer's, and this connection is the app's own)
    conn = await asyncpg.connect(DSN, statement_cache_size=0, server_settings={"application_name": APP_NAME + "-naive"})
    try:
        await conn.execute(
            f"INSERT INTO {LEDGER} (key, amount, pid) VALUES ($1, $2, $3)", key, body["amount"], os.getpid()
        )
    finally:
        await conn.close()
    await hang(request, "after-commit")
    return answer(key)


app = IdempotencyMiddleware(
    api,
    backend=backend,
    routes=[
        RoutePolicy(
            "/pay",
            methods=["POST"],
            required=True,
            single_tenant=True,
            lease=LEASE,
            ttl=3600,
            recover=backend.recover_uncommitted,
        ),
        RoutePolicy(
            "/naive", methods=["POST"], required=True, single_tenant=True, lease=LEASE, ttl=3600, on_expired="reclaim"
        ),
    ],
)
