"""`RoutePolicy(mismatch_status=...)`: a key reused with another request is answered 422 (the IETF
draft) or 409 (UCP and other agent protocols), with the same `fingerprint-mismatch` problem, on
every store, and it never runs the app, whether the first request has finished or is still running."""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

import pytest

from idem_asgi import IdempotencyMiddleware, RoutePolicy
from idem_asgi.backends import Backend
from idem_asgi.errors import ConfigurationError
from idem_asgi.http.openapi import add_openapi
from tests.support.pay import Payments, post


def protect(app: Any, store: Backend, namespace: str, **policy: Any) -> IdempotencyMiddleware:
    return IdempotencyMiddleware(
        app, backend=store, routes=[RoutePolicy("/pay", single_tenant=True, **policy)], namespace=namespace
    )


@pytest.mark.asyncio
@pytest.mark.parametrize("status", [409, 422])
async def test_a_key_reused_with_another_body_gets_the_routes_mismatch_status(
    backend: Backend, namespace: str, status: int
) -> None:
    app = Payments()
    mw = protect(app, backend, namespace, mismatch_status=status)
    key = uuid.uuid4().hex
    first = await post(mw, key, b'{"amount": 10}')
    assert first.status == 201
    other = await post(mw, key, b'{"amount": 99}')
    assert other.status == status and other.problem == "fingerprint-mismatch"
    problem = json.loads(other.body)
    assert problem["status"] == status and problem["title"] == "Idempotency key reused with a different request"
    assert other.headers[b"content-type"] == b"application/problem+json" and b"retry-after" not in other.headers
    again = await post(mw, key, b'{"amount": 10}')
    assert (again.status, again.body, again.replayed) == (201, first.body, True)
    assert app.runs[key] == 1


@pytest.mark.asyncio
async def test_a_mismatch_while_the_first_runs_is_409_mismatch_not_in_progress(
    backend: Backend, namespace: str
) -> None:
    """Both are 409 on such a route: the problem type tells a client which one it got (a retrying client
    waits out `request-in-progress` and gives up on `fingerprint-mismatch`)."""
    gate, entered = asyncio.Event(), asyncio.Event()
    app = Payments()

    async def held(scope: Any, receive: Any, send: Any) -> None:
        entered.set()
        await gate.wait()
        await app(scope, receive, send)

    mw = protect(held, backend, namespace, mismatch_status=409)
    key = uuid.uuid4().hex
    first = asyncio.create_task(post(mw, key, b'{"amount": 10}'))
    await asyncio.wait_for(entered.wait(), 5)
    others = await asyncio.gather(*(post(mw, key, b'{"amount": %d}' % (100 + n)) for n in range(20)))
    same = await post(mw, key, b'{"amount": 10}')
    gate.set()
    assert (await first).status == 201
    assert {(o.status, o.problem) for o in others} == {(409, "fingerprint-mismatch")}
    assert all(b"retry-after" not in o.headers for o in others)
    assert (same.status, same.problem) == (409, "request-in-progress") and b"retry-after" in same.headers
    assert app.runs[key] == 1


def test_mismatch_status_is_409_or_422() -> None:
    with pytest.raises(ConfigurationError, match="mismatch_status must be 409 or 422, got 400"):
        IdempotencyMiddleware(Payments(), routes=[RoutePolicy("/pay", single_tenant=True, mismatch_status=400)])  # type: ignore[arg-type]


def test_the_openapi_document_lists_the_routes_mismatch_status() -> None:
    from fastapi import FastAPI

    app = FastAPI()

    @app.post("/pay")
    async def pay() -> dict[str, int]:
        return {"ok": 1}

    @app.post("/charge")
    async def charge() -> dict[str, int]:
        return {"ok": 1}

    routes = [RoutePolicy("/pay", single_tenant=True, mismatch_status=409), RoutePolicy("/charge", single_tenant=True)]
    app.add_middleware(IdempotencyMiddleware, routes=routes)
    add_openapi(app)
    paths = app.openapi()["paths"]
    pay_answers, charge_answers = paths["/pay"]["post"]["responses"], paths["/charge"]["post"]["responses"]
    assert "422" not in pay_answers and "reused with a different request" in pay_answers["409"]["description"]
    assert charge_answers["422"]["description"] == "Idempotency key reused with a different request."
    assert "reused" not in charge_answers["409"]["description"]


@pytest.mark.asyncio
async def test_the_retrying_client_gives_up_on_a_409_mismatch_and_waits_out_a_409_in_progress(
    backend: Backend, namespace: str
) -> None:
    """`IdempotentRetryTransport` reads a 409's type: a mismatch is final (one attempt), while the
    same key's first request still runs it retries until the answer is there."""
    import httpx

    from idem_asgi.client import IdempotentRetryTransport

    gate = asyncio.Event()
    app = Payments()

    async def slow(scope: Any, receive: Any, send: Any) -> None:
        await gate.wait()
        await app(scope, receive, send)

    mw = protect(slow, backend, namespace, mismatch_status=409)
    attempts: list[int] = []

    async def counted(scope: Any, receive: Any, send: Any) -> None:  # each attempt that reaches the server
        attempts.append(1)
        await mw(scope, receive, send)

    transport = IdempotentRetryTransport(httpx.ASGITransport(app=counted), backoff_base=0.01, backoff_cap=0.05)
    async with httpx.AsyncClient(transport=transport, base_url="http://shop.test") as client:
        key = {"idempotency-key": uuid.uuid4().hex}
        first = asyncio.create_task(client.post("/pay", content=b'{"amount": 10}', headers=key))
        await asyncio.sleep(0.2)
        attempts.clear()
        other = await client.post("/pay", content=b'{"amount": 11}', headers=key)
        assert other.status_code == 409 and other.json()["type"].endswith("fingerprint-mismatch")
        assert len(attempts) == 1, "a mismatch is never retried"
        same = asyncio.create_task(client.post("/pay", content=b'{"amount": 10}', headers=key))
        for _ in range(300):  # Retry-After: 1, honoured
            if len(attempts) >= 3:
                break
            await asyncio.sleep(0.01)
        assert len(attempts) >= 3, "the in-progress 409 was retried"
        gate.set()
        answers = [await first, await same]
    assert [a.status_code for a in answers] == [201, 201] and answers[0].content == answers[1].content
    assert answers[1].headers["idempotent-replayed"] == "true"
    assert sum(app.runs.values()) == 1
