"""Server-derived keys: intent keys from JSON fields, and webhook event ids."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from typing import Any

import httpx
import pytest

from idem_asgi import IdempotencyMiddleware, RoutePolicy, event_id, intent_key, scope_from_header
from idem_asgi._types import Receive, Scope, Send
from idem_asgi.backends import Backend


def counting_app(counts: Counter[str]) -> Any:
    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        counts[scope["path"]] += 1
        await asyncio.sleep(0.02)
        payload = json.dumps({"run": counts[scope["path"]], "echo": body.decode()}).encode()
        await send({"type": "http.response.start", "status": 201, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": payload})

    return app


def client(backend: Backend, namespace: str, counts: Counter[str], **policy: Any) -> httpx.AsyncClient:
    routes = [
        RoutePolicy("/bookings", key=intent_key("user", "booking", "amount"), **policy),
        RoutePolicy("/webhooks/json", methods=["POST"], key=event_id(field="id"), required=True, single_tenant=True),
        RoutePolicy(
            "/webhooks/header", methods=["POST"], key=event_id(header="webhook-id"), required=True, single_tenant=True
        ),
    ]
    mw = IdempotencyMiddleware(
        counting_app(counts), backend=backend, routes=routes, namespace=namespace, scope=scope_from_header("x-user")
    )
    # The bookings route is scoped by user: every request names its user (a missing one is 400).
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=mw), base_url="http://t", headers={"x-user": "u1"})


BOOKING = {"user": "u1", "booking": "b-7", "amount": 4200}


async def test_three_clicks_with_three_header_keys_run_once(backend: Backend, namespace: str) -> None:
    counts: Counter[str] = Counter()
    async with client(backend, namespace, counts, ttl=60) as c:
        answers = []
        for click in range(3):
            body = {**BOOKING, "client_nonce": click}  # clients add noise; the intent fields are what count
            answers.append(await c.post("/bookings", json=body, headers={"Idempotency-Key": f"click-{click}"}))
    assert counts["/bookings"] == 1
    assert [a.status_code for a in answers] == [201, 201, 201]
    assert answers[1].content == answers[2].content == answers[0].content
    assert answers[1].headers["idempotent-replayed"] == "true"


async def test_concurrent_clicks_run_once(backend: Backend, namespace: str) -> None:
    counts: Counter[str] = Counter()
    async with client(backend, namespace, counts, ttl=60) as c:
        answers = await asyncio.gather(*[c.post("/bookings", json=BOOKING) for _ in range(20)])
    assert counts["/bookings"] == 1
    assert {a.status_code for a in answers} <= {201, 409}


async def test_other_intent_values_are_another_operation(backend: Backend, namespace: str) -> None:
    counts: Counter[str] = Counter()
    async with client(backend, namespace, counts, ttl=60) as c:
        await c.post("/bookings", json=BOOKING)
        await c.post("/bookings", json={**BOOKING, "amount": 4300})
        await c.post("/bookings", json=BOOKING, headers={"x-user": "another-user"})
    assert counts["/bookings"] == 3


async def test_a_click_after_the_window_is_a_new_intent(backend: Backend, namespace: str) -> None:
    counts: Counter[str] = Counter()
    async with client(backend, namespace, counts, ttl=0.6, lease=0.5) as c:
        await c.post("/bookings", json=BOOKING)
        await asyncio.sleep(0.9)
        second = await c.post("/bookings", json=BOOKING)
    assert counts["/bookings"] == 2 and "idempotent-replayed" not in second.headers


@pytest.mark.memory
async def test_missing_intent_field_is_400_when_required() -> None:
    from idem_asgi.backends import MemoryBackend

    counts: Counter[str] = Counter()
    async with client(MemoryBackend(), "ns", counts, required=True) as c:
        r = await c.post("/bookings", json={"user": "u1"})
        not_json = await c.post("/bookings", content=b"user=u1")
    assert r.status_code == not_json.status_code == 400
    assert r.json()["type"] == "urn:idem-asgi:problem:key-required"
    assert counts["/bookings"] == 0


@pytest.mark.memory
async def test_missing_intent_field_passes_through_when_optional() -> None:
    from idem_asgi.backends import MemoryBackend

    counts: Counter[str] = Counter()
    async with client(MemoryBackend(), "ns", counts) as c:
        first = await c.post("/bookings", json={"user": "u1"})
        second = await c.post("/bookings", json={"user": "u1"})
    assert counts["/bookings"] == 2
    assert json.loads(first.content)["echo"] == json.loads(second.content)["echo"] == '{"user":"u1"}'


async def test_redelivered_webhook_is_applied_once_and_always_2xx(backend: Backend, namespace: str) -> None:
    counts: Counter[str] = Counter()
    async with client(backend, namespace, counts) as c:
        answers = [
            await c.post("/webhooks/json", json={"id": "evt_1", "type": "charge.succeeded", "attempt": attempt})
            for attempt in range(3)
        ]
    assert counts["/webhooks/json"] == 1
    assert [a.status_code for a in answers] == [201, 201, 201]  # a redelivery with another body is no 422
    assert answers[0].content == answers[1].content == answers[2].content


async def test_webhook_event_id_from_a_header(backend: Backend, namespace: str) -> None:
    counts: Counter[str] = Counter()
    async with client(backend, namespace, counts) as c:
        answers = [await c.post("/webhooks/header", content=b"{}", headers={"webhook-id": "msg_9"}) for _ in range(3)]
        other = await c.post("/webhooks/header", content=b"{}", headers={"webhook-id": "msg_10"})
        missing = await c.post("/webhooks/header", content=b"{}")
    assert counts["/webhooks/header"] == 2
    assert {a.content for a in answers} == {answers[0].content} and other.status_code == 201
    assert missing.status_code == 400
