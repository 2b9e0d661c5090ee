"""Step 6: production settings. Run: python docs/tutorial/step6_production.py"""

import asyncio
import os
import uuid
from collections.abc import AsyncIterator, MutableMapping
from contextlib import asynccontextmanager
from typing import Any

import httpx
from fastapi import FastAPI, Request

from idem_asgi import IdempotencyMiddleware, RoutePolicy, scope_from_header
from idem_asgi.backends import Backend, RedisBackend
from idem_asgi.observe import Event, Observer

REDIS_URL = os.environ.get("IDEM_REDIS_URL", "redis://localhost:6379/0")  # from the environment, with a default

PAYMENTS = RoutePolicy(
    "/payments",
    methods=["POST"],
    required=True,  # a payment without a key is refused (400 key-required), never run unprotected
    ttl=86_400,  # a key protects for 24 h: longer than any client or webhook provider retries
    lease=30,  # a dead worker blocks its key this long, then recovery decides (step 5)
    wait=5,  # a repeat of a running payment waits for its answer instead of a 409
)


charges: list[int] = []


def build_app(backend: Backend, observer: Observer) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        await backend.aclose()  # after the last request: close the pool

    app = FastAPI(lifespan=lifespan)
    app.add_middleware(
        IdempotencyMiddleware,
        backend=backend,  # one instance per process, shared by every request
        routes=[PAYMENTS],
        scope=scope_from_header("x-tenant"),  # set by your gateway, never by the client
        on_store_error="fail_closed",  # store down: 503 store-unavailable, never run unprotected
        observer=observer,  # in production: prometheus_observer(), and alerts on its events
    )

    @app.post("/payments", status_code=201)
    async def pay(request: Request) -> dict[str, object]:
        order = await request.json()
        charges.append(order["amount"])  # in production: the provider's charge, with the same key
        request.state.idempotency.mark_effect()  # money moved: a failure from here on is never re-run
        return {"charge": f"ch_{len(charges)}", "amount": order["amount"]}

    return app


@asynccontextmanager
async def served(app: FastAPI) -> AsyncIterator[None]:
    """What uvicorn does around serving: the ASGI lifespan. At start-up the middleware checks the
    store (a store that can never work fails the start-up); at shut-down the app closes it."""
    inbox: asyncio.Queue[MutableMapping[str, Any]] = asyncio.Queue()
    outbox: asyncio.Queue[MutableMapping[str, Any]] = asyncio.Queue()
    task = asyncio.create_task(app({"type": "lifespan", "asgi": {"version": "3.0"}}, inbox.get, outbox.put))
    await inbox.put({"type": "lifespan.startup"})
    print("start-up:", (await outbox.get())["type"])
    try:
        yield
    finally:
        await inbox.put({"type": "lifespan.shutdown"})
        print("shut-down:", (await outbox.get())["type"])
        await task


async def pay(app: FastAPI, label: str) -> None:
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://shop.test") as client:
        headers = {"Idempotency-Key": "order-6006", "X-Tenant": "acme"}
        r = await client.post("/payments", json={"amount": 990}, headers=headers)
    print(f"{label}: {r.status_code} replayed={r.headers.get('Idempotent-Replayed', 'no')} {r.text}")


async def main() -> None:
    print(f"route {PAYMENTS.path}: methods={list(PAYMENTS.methods)} required={PAYMENTS.required}", end=" ")
    print(f"ttl={PAYMENTS.ttl} lease={PAYMENTS.lease} wait={PAYMENTS.wait}")
    events: list[Event] = []

    # This run's own prefix, deleted at the end, so the tutorial leaves nothing behind.
    # In production: one fixed prefix per app (the default is "idem:").
    prefix = f"tutorial:{uuid.uuid4().hex}:"
    backend = RedisBackend.from_url(REDIS_URL, prefix=prefix)
    app = build_app(backend, events.append)
    async with served(app):
        await pay(app, "pay")
        await pay(app, "pay again")
        async for name in backend.client.scan_iter(match=f"{prefix}*", count=10_000):
            await backend.client.delete(name)
    print("events:", ", ".join(e.name for e in events))
    print("charges:", len(charges))


if __name__ == "__main__":
    asyncio.run(main())
