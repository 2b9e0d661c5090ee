"""Body work costs what it must, and when it must: cheap refusals never read the body, and a large
body is fingerprinted off the event loop, so other requests are answered meanwhile."""

from __future__ import annotations

import json
import threading
import uuid
from typing import Any

import anyio
import httpx
import pytest

import idem_asgi.http.fields
import idem_asgi.http.fingerprint
from idem_asgi import Fields, IdempotencyMiddleware, RoutePolicy, custom
from idem_asgi._types import Message, Receive, Scope, Send
from idem_asgi.backends import Backend
from idem_asgi.http.fingerprint import OFFLOAD_BYTES
from idem_asgi.http.problems import SCOPE_REQUIRED
from tests.support.asgi import Result, http_scope
from tests.support.charges import Payments
from tests.support.problems import assert_problem


async def test_a_scoped_request_naming_nobody_is_refused_before_its_body_is_read(
    backend: Backend, namespace: str
) -> None:
    fingerprinted: list[bytes] = []

    def rule(scope: Scope, body: bytes) -> bytes:
        fingerprinted.append(body)
        return b"x"

    app = Payments()
    mw = IdempotencyMiddleware(
        app,
        backend=backend,
        namespace=namespace,
        routes=[RoutePolicy("/payments", fingerprint=custom(rule))],
        scope=lambda scope: None,  # no authenticated caller
    )
    received = 0

    async def receive() -> Message:
        nonlocal received
        received += 1
        return {"type": "http.request", "body": b'{"amount": 1}', "more_body": False}

    result = Result()

    async def send(message: Message) -> None:
        result.messages.append(dict(message))

    await mw(http_scope(key=uuid.uuid4().hex), receive, send)
    assert_problem(result, SCOPE_REQUIRED)
    assert received == 0 and fingerprinted == [] and app.calls == 0


async def test_another_route_is_answered_while_a_large_body_is_fingerprinted(
    backend: Backend, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The JSON decoder is held (in whatever thread runs it) until /health has been answered: if the
    fingerprint ran on the event loop, /health could not be answered until the decoder gave up."""
    decoding = threading.Event()
    health_answered = threading.Event()
    released_by_health: list[bool] = []
    decode = idem_asgi.http.fields.json_decode

    def held_decode(body: bytes) -> Any:
        decoding.set()
        released_by_health.append(health_answered.wait(5))
        return decode(body)

    monkeypatch.setattr(idem_asgi.http.fingerprint, "json_decode", held_decode)  # what Fields calls

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["path"] == "/health":
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"ok"})
            health_answered.set()
            return
        await Payments()(scope, receive, send)

    policy = RoutePolicy("/payments", fingerprint=Fields(only=["amount"]), single_tenant=True)
    mw = IdempotencyMiddleware(app, backend=backend, namespace=namespace, routes=[policy])
    body = json.dumps({"amount": 5, "items": ["x" * 100] * (OFFLOAD_BYTES // 100)}).encode()
    transport = httpx.ASGITransport(app=mw)
    async with (
        httpx.AsyncClient(transport=transport, base_url="http://test") as client,
        anyio.create_task_group() as tg,
    ):
        answers: dict[str, int] = {}

        async def pay() -> None:
            answers["pay"] = (
                await client.post("/payments", content=body, headers={"Idempotency-Key": "k"})
            ).status_code

        tg.start_soon(pay)
        await anyio.to_thread.run_sync(decoding.wait, 5)
        answers["health"] = (await client.get("/health")).status_code
    assert answers == {"health": 200, "pay": 201}
    assert released_by_health == [True]  # the decoder was still held when /health was answered


async def test_a_body_in_many_chunks_reaches_the_app_as_those_chunks_uncopied(backend: Backend, namespace: str) -> None:
    """The middleware never joins a streamed body: the app gets the very chunk objects the client
    sent, in order (it joins them itself, as without us), and a replay still answers the first's bytes."""
    got: list[list[Message]] = []

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        messages = [await receive()]
        while messages[-1].get("more_body", False):
            messages.append(await receive())
        got.append(messages)
        size = sum(len(m["body"]) for m in messages)
        await send({"type": "http.response.start", "status": 201, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": str(size).encode()})

    mw = IdempotencyMiddleware(
        app, backend=backend, namespace=namespace, routes=[RoutePolicy("/upload", single_tenant=True)]
    )
    chunks = [bytes([65 + i]) * (64 * 1024) for i in range(5)]
    key = uuid.uuid4().hex

    async def post() -> Result:
        queue = list(chunks)

        async def receive() -> Message:
            if queue:
                chunk = queue.pop(0)
                return {"type": "http.request", "body": chunk, "more_body": bool(queue)}
            await anyio.sleep_forever()
            raise AssertionError

        result = Result()

        async def send(message: Message) -> None:
            result.messages.append(dict(message))

        await mw(http_scope(path="/upload", key=key), receive, send)
        return result

    first, again = await post(), await post()
    assert len(got) == 1, "the repeat was replayed, not run"
    assert [m["body"] for m in got[0]] == chunks
    assert all(m["body"] is c for m, c in zip(got[0], chunks, strict=True)), "a chunk was copied"
    assert [m["more_body"] for m in got[0]] == [True] * 4 + [False]
    assert first.body == again.body == str(5 * 64 * 1024).encode()
