"""POST /payments, the endpoint of the decision-table tests, and how they reach it.

`Payments` counts its executions (each answers with its own charge number); `protect` puts the
middleware in front of it; `post` sends one request through httpx's ASGI transport; `rk` is the
record key the middleware uses; `crash_first_request` leaves a stuck claim (holder killed, lease
over, seen so for its grace).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable
from typing import Any, Literal

import httpx

from idem_asgi import IdempotencyMiddleware, RoutePolicy
from idem_asgi._types import Receive, Scope, Send
from idem_asgi.backends import Backend
from idem_asgi.claims.leases import grace
from idem_asgi.records import RecordKey
from tests.support.asgi import read_body

KEY = "pay-7f3a"
BODY = b'{"amount":1230,"currency":"EUR"}'
LEASE = 0.2


class Payments:
    """A raw ASGI payment endpoint that counts executions.

    Each execution answers 201 with its own charge number, so a replay (charge 1 again) is
    told apart from a second execution (charge 2). `gate` holds every execution until set;
    `hang_first` makes the first execution hang forever (a holder that will be killed).
    """

    def __init__(self, *, gate: asyncio.Event | None = None, hang_first: bool = False, delay: float = 0.0) -> None:
        self.calls = 0
        self.bodies: list[bytes] = []
        self.entered = asyncio.Event()
        self.gate = gate
        self.hang_first = hang_first
        self.delay = delay

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        body = await read_body(receive)
        self.calls += 1
        self.bodies.append(body)
        n = self.calls
        self.entered.set()
        if self.hang_first and n == 1:
            await asyncio.Event().wait()
        if self.gate is not None:
            await self.gate.wait()
        if self.delay:
            await asyncio.sleep(self.delay)
        payload = json.dumps({"charge": n, "amount_body": body.decode("latin-1")}).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"x-charge", str(n).encode()),
            (b"content-length", str(len(payload)).encode()),
        ]
        await send({"type": "http.response.start", "status": 201, "headers": headers})
        await send({"type": "http.response.body", "body": payload, "more_body": False})


def protect(
    app: Any,
    backend: Backend,
    namespace: str = "idem",
    *,
    on_store_error: Literal["fail_closed", "fail_open"] = "fail_closed",
    scope: Callable[[Scope], str | None] | None = None,
    **policy: Any,
) -> IdempotencyMiddleware:
    """The middleware protecting POST /payments with the given policy options."""
    policy.setdefault("single_tenant", scope is None)
    return IdempotencyMiddleware(
        app,
        backend=backend,
        namespace=namespace,
        routes=[RoutePolicy("/payments", methods=["POST"], **policy)],
        on_store_error=on_store_error,
        scope=scope,
    )


async def post(
    app: Any,
    key: str | None = KEY,
    body: bytes = BODY,
    *,
    path: str = "/payments",
    headers: dict[str, str] | None = None,
    raise_app_exceptions: bool = True,
) -> httpx.Response:
    """One POST through httpx's ASGI transport."""
    sent = dict(headers or {})
    if key is not None:
        sent["Idempotency-Key"] = key
    transport = httpx.ASGITransport(app=app, raise_app_exceptions=raise_app_exceptions)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        return await client.post(path, content=body, headers=sent)


def rk(namespace: str, key: str = KEY, scope: str | None = None) -> RecordKey:
    """The record key the middleware uses for (namespace, scope, key)."""
    return RecordKey.build(namespace, scope, key)


async def crash_first_request(mw: IdempotencyMiddleware, app: Payments) -> None:
    """Start a request whose handler hangs, then kill it mid-operation and let its lease run out.

    A repeat then sees the expired lease once (answered `request-in-progress`: its holder might be
    alive, about to renew) and, `grace` later, still unchanged: from then on the holder counts as
    gone, which is where the tests of what follows a crash begin."""
    task = asyncio.ensure_future(post(mw))
    await asyncio.wait_for(app.entered.wait(), 5)
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    await asyncio.sleep(LEASE + 0.1)
    first = await post(mw)
    assert first.status_code == 409 and "request-in-progress" in first.text, first.text
    await asyncio.sleep(grace(LEASE))
