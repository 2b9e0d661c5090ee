"""One claim machinery per process and store: the middleware, jobs and consumers that claim in one
store share its lease renewer, late writes and held repeats (`idem_asgi.claims.runtime`)."""

from __future__ import annotations

import asyncio
import uuid

import httpx
import pytest

from idem_asgi import IdempotencyMiddleware, RoutePolicy, current_idempotency
from idem_asgi._types import Receive, Scope, Send
from idem_asgi.claims.runtime import machinery_for
from idem_asgi.jobs.consumers import apply_once
from idem_asgi.jobs.decorator import current_job, idempotent
from tests.support.stores import BACKENDS, make_backend

pytestmark = pytest.mark.asyncio


@pytest.mark.parametrize("store_name", BACKENDS)
async def test_http_a_job_and_a_consumer_in_one_store_hold_their_claims_in_one_machinery(store_name: str) -> None:
    """While a request runs a job which applies a message, all three claims are held by the one
    renewer of that store in this process, so none of them is ever taken for a dead holder's."""
    store = await make_backend(store_name)
    machinery = machinery_for(store)
    held: dict[str, bool] = {}
    ns = f"shared-{uuid.uuid4().hex}"

    async def on_message() -> None:
        request, message = current_idempotency(), current_job()
        assert request is not None and request.claim is not None and message is not None
        http = request.claim
        assert http.rkey is not None
        held["http"] = machinery.holds(http.rkey.digest, http.token)
        assert message.rkey is not None
        held["message"] = machinery.holds(message.rkey.digest, message.token)
        held["one renewer"] = message.rt.leases is machinery.leases

    @idempotent(store, args=["order"], namespace=ns)
    async def charge(order: str) -> str:
        job = current_job()
        assert job is not None and job.rkey is not None
        held["job"] = machinery.holds(job.rkey.digest, job.token) and job.rt.leases is machinery.leases
        await apply_once(store, f"msg-{order}", b"{}", on_message, namespace=ns, ttl=60, lease=30, wait=0)
        return order

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        await charge("o-1")
        await send({"type": "http.response.start", "status": 201, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    middleware = IdempotencyMiddleware(
        app, backend=store, routes=[RoutePolicy("/pay", methods=["POST"], single_tenant=True)], namespace=ns
    )
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=middleware), base_url="http://t") as client:
            answer = await client.post("/pay", headers={"Idempotency-Key": "k-1"}, content=b"{}")
        assert answer.status_code == 201
        assert middleware.runtime.leases is machinery.leases
        assert middleware.runtime.waiters is machinery.waiters
        assert held == {"http": True, "job": True, "message": True, "one renewer": True}
        await asyncio.sleep(0)
    finally:
        await store.aclose()
