"""The HTTP surface of the fault matrix: one route behind `IdempotencyMiddleware`, run under uvicorn.

POST /pay (the `Idempotency-Key` header is the key) runs `fault_points.work(plan, key, store)` and
answers 201 with `{"key", "result", "pid"}`; GET /health answers `{"pid": ...}` (for
`UvicornProcess.wait_ready`). The plan comes from the environment (`IDEM_FAULT_RUN`,
`IDEM_FAULT_POINTS`: tests/support/fault_points.py), and the middleware's store is
`PointStore(<the real store>)`, so a key stops at its point, the first time it gets there
(the first time only): `before_claim`, `before_store` and `after_store` in the store wrapper, `after_claim`,
`mid_effect` and `in_transaction` in the handler.

Other variables: `IDEM_FAULT_STORE` (the store's URL), `IDEM_FAULT_PREFIX` (Redis key prefix),
`IDEM_FAULT_TABLE` (Postgres table), `IDEM_FAULT_NAMESPACE` (the middleware's namespace),
`IDEM_FAULT_LEASE`, `IDEM_FAULT_TTL`, `IDEM_FAULT_POOL` (the store's connections),
`IDEM_FAULT_UNSTOPPED` (set: the worker that settles a run; the same plan, its keys never stopped).

    python -m uvicorn tests.faults.http_app:app --lifespan on

Importing this module has no side effect: everything is built at lifespan start-up and closed at
its shutdown (the store's `aclose()` drains its pending late writes first).
"""

from __future__ import annotations

import json
import os
from typing import Any

from idem_asgi import IdempotencyMiddleware, RoutePolicy
from idem_asgi._types import ASGIApp, Receive, Scope, Send
from tests.faults.key_outcomes import STORE_TIMEOUT
from tests.support.fault_points import Plan, PointStore, work
from tests.support.servers import REDIS_URL
from tests.support.stores import TEST_TABLE, store_from_url


class Handler:
    """POST /pay: the matrix's work for the key; GET /health: the pid."""

    def __init__(self, plan: Plan, store: PointStore) -> None:
        self.plan = plan
        self.store = store

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        while (await receive()).get("more_body", False):
            pass
        if scope["path"] != "/pay":
            await answer(send, 200, {"pid": os.getpid()})
            return
        key = next(v for k, v in scope["headers"] if k == b"idempotency-key").decode()
        result = await work(self.plan, key, self.store)
        await answer(send, 201, {"key": key, "result": result, "pid": os.getpid()})


async def answer(send: Send, status: int, doc: dict[str, Any]) -> None:
    body = json.dumps(doc).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})


class _LazyApp:
    """The uvicorn entry point: builds the stack from the environment at lifespan start-up."""

    def __init__(self) -> None:
        self.app: ASGIApp | None = None
        self.store: PointStore | None = None
        self.plan: Plan | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "lifespan":
            assert self.app is not None, "lifespan start-up did not run"
            await self.app(scope, receive, send)
            return
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                env = os.environ
                self.plan = Plan(stops=not env.get("IDEM_FAULT_UNSTOPPED"))
                real = store_from_url(
                    env.get("IDEM_FAULT_STORE", REDIS_URL),
                    prefix=env.get("IDEM_FAULT_PREFIX", ""),
                    table=env.get("IDEM_FAULT_TABLE", TEST_TABLE),
                    pool=int(env.get("IDEM_FAULT_POOL", "8")),
                    timeout=STORE_TIMEOUT,
                )
                self.store = PointStore(real, self.plan)
                policy = RoutePolicy(
                    "/pay",
                    methods=["POST"],
                    required=True,
                    single_tenant=True,
                    lease=float(env.get("IDEM_FAULT_LEASE", "2")),
                    ttl=float(env.get("IDEM_FAULT_TTL", "600")),
                )
                self.app = IdempotencyMiddleware(
                    Handler(self.plan, self.store),
                    backend=self.store,
                    routes=[policy],
                    namespace=env.get("IDEM_FAULT_NAMESPACE", "fault-http"),
                )
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self.store is not None:
                    await self.store.aclose()
                if self.plan is not None:
                    await self.plan.aclose()
                await send({"type": "lifespan.shutdown.complete"})
                return


app = _LazyApp()
