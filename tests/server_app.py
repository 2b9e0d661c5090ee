"""The README's FastAPI setup, run by the ASGI-server matrix (tests/test_asgi_servers.py) under
granian, hypercorn and gunicorn with uvicorn workers.

The middleware is added as README.md's "Five lines on FastAPI" shows, and the store is closed
in the lifespan as docs/production.md's FastAPI block does; the server starts the app, so the
middleware's start-up check runs in each worker. Configured by environment variables:

- `IDEM_SERVERS_STORE`: the store URL (`redis://...` or `postgresql://...?application_name=...`).
- `IDEM_SERVERS_TABLE`: the Postgres table (one per test run).
- `IDEM_SERVERS_COUNTER`: the Redis that counts executions per key (the ground truth across workers).

POST /payments counts its execution, sleeps 20 ms (or `X-Delay-Ms`: time for the test's client to
hang up mid-request) and answers 201 with a fresh uuid and the worker's pid; GET /health answers
the pid (how the test knows every worker serves). A worker's lifespan shutdown closes the store,
then appends its pid to the Redis list `closed` (how the test knows each worker's shutdown ran).
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import redis.asyncio as aioredis
from fastapi import FastAPI, Request
from pydantic import BaseModel

from idem_asgi import IdempotencyMiddleware, RoutePolicy, scope_from_header
from idem_asgi.backends import Backend, PostgresBackend, RedisBackend

STORE = os.environ["IDEM_SERVERS_STORE"]
COUNTER_URL = os.environ["IDEM_SERVERS_COUNTER"]
TABLE = os.environ.get("IDEM_SERVERS_TABLE", "idem_records")


def make_backend() -> Backend:
    if STORE.startswith(("postgres://", "postgresql://")):
        return PostgresBackend.from_url(STORE, table=TABLE, min_size=1, max_size=10)
    return RedisBackend.from_url(STORE)


class Payment(BaseModel):
    amount: int
    currency: str


backend = make_backend()
counter: dict[str, Any] = {}


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    pool = aioredis.BlockingConnectionPool.from_url(COUNTER_URL, max_connections=32, timeout=10)
    counter["client"] = aioredis.Redis.from_pool(pool)
    yield
    await backend.aclose()  # after the last request: close the pool
    client = counter.pop("client")
    await client.rpush("closed", os.getpid())  # for the test: this worker's shutdown ran, the store is closed
    await client.aclose()


app = FastAPI(lifespan=lifespan)
app.add_middleware(
    IdempotencyMiddleware,
    backend=backend,
    routes=[RoutePolicy("/payments", methods=["POST"], ttl=600, required=True)],
    scope=scope_from_header("x-tenant-id"),
)


@app.get("/health")
async def health() -> dict[str, Any]:
    return {"ok": True, "pid": os.getpid()}


@app.post("/payments", status_code=201)
async def pay(payment: Payment, request: Request) -> dict[str, Any]:
    key = request.headers["idempotency-key"]
    await counter["client"].incr(f"executions:{key}")
    await asyncio.sleep(int(request.headers.get("x-delay-ms", "20")) / 1000)
    return {"key": key, "amount": payment.amount, "payment": uuid.uuid4().hex, "pid": os.getpid()}
